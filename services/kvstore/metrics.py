"""The kvstore's Prometheus metrics (docs/metrics.md names: meshllm:kvstore_*)."""
from __future__ import annotations

import asyncio

from prometheus_client import Counter, Gauge

from services.common.metrics import PREFIX

LOOKUPS = Counter(PREFIX + "kvstore_lookups_total", "Lookup calls answered")
PUTS = Counter(PREFIX + "kvstore_put_blocks_total", "blocks offered by Put, by outcome", ["status"])
GETS = Counter(PREFIX + "kvstore_get_blocks_total", "blocks asked for by Get, by result", ["result"])
BLOCKS = Gauge(PREFIX + "kvstore_blocks", "blocks stored, by tier", ["tier"])
BYTES = Gauge(PREFIX + "kvstore_bytes", "bytes stored, by tier", ["tier"])
CAPACITY = Gauge(PREFIX + "kvstore_capacity_bytes", "the hard bound of each tier", ["tier"])
EVICTIONS = Gauge(PREFIX + "kvstore_evictions", "blocks evicted from host memory since start")
CORRUPT = Gauge(PREFIX + "kvstore_corrupt_blocks", "blocks found corrupt on read (each was a miss and removed)")
COMMIT_MISMATCHES = Gauge(PREFIX + "kvstore_commit_mismatch_blocks",
                          "blocks committed zero-copy whose bytes did not match their writer's checksum, "
                          "found after the Commit and removed (also in kvstore_corrupt_blocks)")
UNVERIFIED = Gauge(PREFIX + "kvstore_unverified_bytes", "bytes committed and not yet re-checked by the store")


async def refresh_gauges(store, executor, every_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    while True:
        backend, _ = await loop.run_in_executor(executor, store.stats)
        tier = "redis" if backend.name == "redis" else "memory"
        BLOCKS.labels(tier).set(backend.blocks)
        BYTES.labels(tier).set(backend.bytes)
        CAPACITY.labels(tier).set(backend.capacity_bytes)
        if backend.disk_capacity_bytes:
            BLOCKS.labels("disk").set(backend.disk_blocks)
            BYTES.labels("disk").set(backend.disk_bytes)
            CAPACITY.labels("disk").set(backend.disk_capacity_bytes)
        EVICTIONS.set(backend.evictions)
        CORRUPT.set(backend.corrupt_blocks)
        COMMIT_MISMATCHES.set(backend.extra.get("commit_mismatches", 0))
        UNVERIFIED.set(backend.extra.get("unverified_bytes", 0))
        await asyncio.sleep(every_s)
