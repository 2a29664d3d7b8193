"""The start-up heap is frozen out of the collector's scans (services/common/gc_heap.py): what is
alive moves to the permanent generation, cyclic garbage made before is collected first, garbage
made after is still collected."""
from __future__ import annotations

import gc
import logging

from services.common.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other = self


def test_freeze_collects_first_then_freezes_what_lives_and_later_garbage_still_goes(caplog):
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
        gc.unfreeze()
