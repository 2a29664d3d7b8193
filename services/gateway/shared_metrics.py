"""`GET /metrics` when several gateway processes share the public ports (the launcher's
`--api-server-count N`, docs/metrics.md "Several gateway processes").

A scrape reaches one process chosen by the kernel (SO_REUSEPORT), so no process may answer
with its own counts. Every process runs in prometheus_client's multiprocess mode: its
counters, histograms and gauges live in files of one shared directory
(PROMETHEUS_MULTIPROC_DIR, created and removed by the launcher), and a scrape of any process
adds up every file. The values the gateway reads at scrape time (the engine pool's view,
requests in flight) are copied into this process's files every SYNC_INTERVAL_S and just
before each scrape it answers; a sibling's values are at most that old.

Counters and histograms add up over every process, exited ones included (totals never go
down when one restarts). Gauges are merged over the live processes only (the metric names
and labels stay those of one process):
- engine_replica_outstanding_tokens, engine_replica_requests_inflight,
  gateway_requests_inflight: summed, the load that all processes put on a replica;
- engine_replica_routable, engine_replica_role: the largest, 1 while any process says so.
"""
from __future__ import annotations

import asyncio
import logging
import os

from prometheus_client import CollectorRegistry, multiprocess

from services.common.metrics import (PREFIX, CollectorMirror, forget_exited_processes,
                                     multiprocess_registry)
from services.gateway.clients.pool_metrics import PoolCollector
from services.gateway.http.metrics import write_tracked_gauges

log = logging.getLogger("meshllm.gateway.metrics")

SYNC_INTERVAL_S = 1.0

POOL_GAUGE_MERGES = {
    PREFIX + "engine_replica_routable": "max",
    PREFIX + "engine_replica_outstanding_tokens": "sum",
    PREFIX + "engine_replica_requests_inflight": "sum",
    PREFIX + "engine_replica_role": "max",
}


class SharedMetrics:
    """This process's share of the metrics of every gateway process writing into `path`."""

    def __init__(self, path: str, engine_pool) -> None:
        self.path = path
        self.registry: CollectorRegistry = multiprocess_registry(path)
        self._mirror = CollectorMirror(path, POOL_GAUGE_MERGES)
        self._mirror.add(PoolCollector(engine_pool))

    def sync(self) -> None:
        """This process's scrape-time values of now, into its files."""
        write_tracked_gauges()
        self._mirror.sync()

    def scrape_registry(self) -> CollectorRegistry:
        try:
            self.sync()
        except OSError as exc:   # the scrape still answers, with this process's last copy
            log.warning("metrics: cannot write this process's values to %s: %s", self.path, exc)
        return self.registry

    async def run(self) -> None:
        failing = False
        while True:
            try:
                self.sync()
                gone = forget_exited_processes(self.path)
            except OSError as exc:   # a full disk, say: keep serving, say it once until it recovers
                if not failing:
                    log.warning("metrics: cannot write this process's values to %s: %s", self.path, exc)
                failing, gone = True, []
            else:
                failing = False
            if gone:
                log.info("metrics: gateway processes %s exited; their in-flight gauges dropped", gone)
            await asyncio.sleep(SYNC_INTERVAL_S)

    def close(self) -> None:
        """On exit: this process's gauges stop counting (its counters stay)."""
        self._mirror.close()
        multiprocess.mark_process_dead(os.getpid(), self.path)
