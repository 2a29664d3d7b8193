"""Prometheus view of the gateway's engine replicas, read from the pool at scrape time
(nothing is counted on the request path here): which replicas take new requests, their
load as the router sees it, how requests were routed and how many were moved to another
replica before their first token."""
from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.metrics import PREFIX


class PoolCollector:
    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        routable = GaugeMetricFamily(PREFIX + "engine_replica_routable",
                                     "1 while the gateway sends new requests to the replica",
                                     labels=["replica"])
        outstanding = GaugeMetricFamily(PREFIX + "engine_replica_outstanding_tokens",
                                        "prompt + max_tokens - generated of the requests in "
                                        "flight on the replica (the router's load)",
                                        labels=["replica"])
        inflight = GaugeMetricFamily(PREFIX + "engine_replica_requests_inflight",
                                     "requests the gateway has in flight on the replica",
                                     labels=["replica"])
        role = GaugeMetricFamily(PREFIX + "engine_replica_role", "1 for the replica's kv_role (docs/pd.md): "
                                 "prefill, decode, or colocated", labels=["replica", "role"])
        for r in self.pool.replicas():
            rid = r.spec.replica_id
            routable.add_metric([rid], 1.0 if r.routable else 0.0)
            if r.client.info is not None:
                role.add_metric([rid, r.client.info.kv_role or "colocated"], 1.0)
            outstanding.add_metric([rid], r.client.outstanding_tokens)
            inflight.add_metric([rid], r.client.num_inflight)
        routed = CounterMetricFamily(PREFIX + "gateway_routed_requests",
                                     "requests routed, by rule (affinity, least_loaded, "
                                     "affinity_busy)", labels=["reason"])
        for reason, n in sorted(self.pool.routed.items()):
            routed.add_metric([reason], n)
        retried = CounterMetricFamily(PREFIX + "gateway_requests_moved_before_first_token",
                                      "requests resubmitted to another replica because theirs "
                                      "failed or stopped taking work before their first token")
        retried.add_metric([], self.pool.retries)
        handoffs = CounterMetricFamily(PREFIX + "gateway_pd_handoffs",
                                       "prefill -> decode hand-offs (docs/pd.md), by outcome: kvstore (blocks "
                                       "loaded), recompute (none saved), colocated_fallback (no decode engine), "
                                       "prefill_lost_retried, prefill_lost_computed_whole, no_engine",
                                       labels=["outcome"])
        for outcome, n in sorted(self.pool.handoffs.items()):
            handoffs.add_metric([outcome], n)
        yield from (routable, outstanding, inflight, routed, retried, handoffs, role)


def register(pool) -> None:
    REGISTRY.register(PoolCollector(pool))
