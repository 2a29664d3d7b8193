"""Prometheus metrics of the supervisor (docs/supervisor.md lists them)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge

from services.common.metrics import PREFIX
from services.supervisor.state import State

REPLICA_STATE = Gauge(PREFIX + "supervisor_replica_state",
                      "1 for the state each replica is in now, 0 for the others",
                      ["replica", "kind", "state"])
RESTARTS = Counter(PREFIX + "supervisor_restarts_total", "restarts of a replica after a failure",
                   ["replica", "kind"])
FAILURES = Counter(PREFIX + "supervisor_failures_total",
                   "failures seen (a dead process, an unanswered probe, readiness lost too long)",
                   ["replica", "kind"])
READY_REPLICAS = Gauge(PREFIX + "supervisor_ready_replicas", "replicas in the READY state, by kind", ["kind"])


_counted: dict[str, int] = {}   # restarts already added to RESTARTS, by replica id


def publish(replicas) -> None:
    ready: dict[str, int] = {}
    for r in replicas:
        for s in State:
            REPLICA_STATE.labels(r.spec.id, r.kind_name, s.value).set(1 if r.machine.state is s else 0)
        # The machine counts restarts; the counter follows it (only ever upwards).
        missing = r.machine.restarts - _counted.get(r.spec.id, 0)
        counter = RESTARTS.labels(r.spec.id, r.kind_name)   # listed at 0 from the start
        if missing > 0:
            counter.inc(missing)
            _counted[r.spec.id] = r.machine.restarts
        ready[r.kind_name] = ready.get(r.kind_name, 0) + (r.machine.state is State.READY)
    for kind, n in ready.items():
        READY_REPLICAS.labels(kind).set(n)


def failed(r) -> None:
    FAILURES.labels(r.spec.id, r.kind_name).inc()
