"""The KV tiers' metric families (docs/kvstore.md, kv_tiers.md), labelled by tier: "kvstore" for
the kvstore client (kv_client.py, kv_link.py), "host" and "direct" for the worker's own tiers
(services/worker/kv_tiers.py, which reaches them as kv_client.HITS etc.)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import PREFIX, RPC_LATENCY_BUCKETS

HITS = Counter(PREFIX + "kv_tier_hit_blocks_total", "blocks loaded from a KV tier", ["tier"])
MISSES = Counter(PREFIX + "kv_tier_miss_blocks_total", "blocks asked for and not loaded (absent, corrupt, "
                 "or the tier unreachable)", ["tier"])
SAVED = Counter(PREFIX + "kv_tier_saved_blocks_total", "blocks saved to a KV tier", ["tier"])
DROPPED = Counter(PREFIX + "kv_tier_dropped_blocks_total", "blocks whose save was refused or dropped", ["tier"])
BYTES = Counter(PREFIX + "kv_tier_bytes_total", "bytes moved to (save) and from (load) a KV tier",
                ["tier", "direction"])
SECONDS = Histogram(PREFIX + "kv_tier_transfer_seconds", "one load or save call, end to end",
                    ["tier", "direction"], buckets=RPC_LATENCY_BUCKETS)
GBPS = Gauge(PREFIX + "kv_tier_last_gbps", "GB/s of the last load or save call", ["tier", "direction"])
AVAILABLE = Gauge(PREFIX + "kv_tier_available", "1 while the tier answers, 0 once it is lost", ["tier"])
TIER = "kvstore"
