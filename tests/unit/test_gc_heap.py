"""The start-up heap is frozen out of the collector's scans (services/common/gc_heap.py): what is
alive moves to the permanent generation, cyclic garbage made before is collected first, garbage
made after is still collected; the first generation's threshold is widened so a step's worth of
short-lived containers triggers no collection, while cyclic garbage past it still does."""
from __future__ import annotations

import gc
import logging

from services.common.gc_heap import GEN0_THRESHOLD, freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other = self


def test_freeze_collects_first_then_freezes_what_lives_and_later_garbage_still_goes(caplog):
    before = gc.get_threshold()
    gc.unfreeze()
    try:
        kept = [Node() for _ in range(1000)]
        for _ in range(500):
            Node()                                  # cycles: garbage only a collection frees
        with caplog.at_level(logging.INFO):
            frozen = freeze_startup_heap(logging.getLogger("t"))
        assert frozen >= len(kept) and gc.get_freeze_count() > 0
        assert "froze" in caplog.text
        assert not any(isinstance(o, Node) for o in gc.get_objects()), "the kept nodes left the tracked generations"
        for _ in range(300):
            Node()
        assert gc.collect() >= 300, "cycles made after the freeze are still collected"
        assert all(n.other is n for n in kept)
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def test_a_steps_churn_triggers_no_collection_but_cyclic_garbage_past_the_threshold_does():
    before = gc.get_threshold()
    gc.unfreeze()
    runs: list[int] = []

    def on_gc(phase, info):
        if phase == "start":
            runs.append(info["generation"])
    try:
        freeze_startup_heap()
        assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2])
        gc.callbacks.append(on_gc)
        for _ in range(20):                     # 20 "steps", each holding 5,000 containers at once
            held = [[i] for i in range(5000)]
            del held
        assert runs == [], f"collections during short-lived churn: {runs}"
        cycles = [Node() for _ in range(GEN0_THRESHOLD + 1000)]
        del cycles                              # the list goes, each node keeps itself alive
        for _ in range(2000):
            Node()
        assert runs, "cyclic garbage past the threshold was never collected"
    finally:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
        gc.set_threshold(*before)
        gc.unfreeze()
        gc.collect()
