"""Keep Python's cyclic garbage collector off a service's startup heap.

After start-up a service holds hundreds of thousands of long-lived objects (imported modules,
the model's Python objects, protobuf descriptors, compiled kernels' metadata). Every full
(generation-2) collection walks all of them, and the hot loops (the worker's steps, the
scheduler's plans, the gateway's streams) allocate enough short-lived containers to trigger one
every second or so: on the H200 the offline 8B benchmark spent 4.5 s of 49 s in 39 full
collections, up to 127 ms each (bench/results/gpu_fp8_offline_gc.json). `gc.freeze()` moves
everything alive at that point into a permanent generation the collector never scans (as vLLM and
SGLang do after start-up): 0.6 s, 17 ms at most (gpu_fp8_offline_gc_freeze.json). Objects made
later are collected as before; frozen ones that become garbage are simply never reclaimed, which
start-up state never does.

What the freeze leaves: every full collection still walks the live requests' token lists, one
reference per token (512 requests of 2,048 tokens: ~10 ms on a 2-core CI box just to visit 1M
ints), and a step of 512 sequences makes and drops ~5,000 containers, so the default first
threshold (700 more allocations than deallocations) fired ~7 times a step, promoted what the
in-flight steps still held, and a full collection followed every ~18 steps: on the H200 the 8B
offline run (512 x 1k/1k) spent 2.7 s of 32 s collecting, 60 full collections of ~25 ms each,
longer than a decode step (bench/results/gpu_fp8_math_h200.json). Nearly all of those containers
die by reference counting within their step, so a first threshold of GEN0_THRESHOLD (well above
one step's churn) lets them go without a collection at all; cyclic garbage still is collected,
after that many more allocations than deallocations. The CPU rehearsal (bench/gpu_decode.offline
on a tiny model, 512 requests): 1,872 / 170 / 15 collections of each generation -> 1 / 1 / 0.
"""
from __future__ import annotations

import gc
import logging


GEN0_THRESHOLD = 50_000


def freeze_startup_heap(log: logging.Logger | None = None) -> int:
    """Collect once, freeze what is left, and widen the first generation's threshold to
    GEN0_THRESHOLD (the older ones' stay) -> how many objects are frozen in all."""
    gc.collect()
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(max(GEN0_THRESHOLD, t0), t1, t2)
    n = gc.get_freeze_count()
    if log is not None:
        log.info("froze %d start-up objects out of the garbage collector's scans; first threshold %d",
                 n, gc.get_threshold()[0])
    return n
