"""The scheduler's Prometheus metrics: request latencies, tokens, steps and engine state.

Costs on the serving path: one record per request (timestamps, kept in the adapter's map
of live requests and dropped at finish), histogram observations once per request phase
and three per step, one counter increment per step for generated tokens. Engine state
(running / waiting requests, KV usage, prefix-cache and preemption counters) is read from
the core only when Prometheus scrapes, so it costs nothing between scrapes.

Every metric carries `model_name` and `engine` (the engine / DP replica id) labels."""
from __future__ import annotations

import time

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.metrics import (BATCH_SIZE_BUCKETS, PREFIX, REQUEST_LATENCY_BUCKETS,
                                     STEP_LATENCY_BUCKETS, TOKEN_COUNT_BUCKETS, traceparent_exemplar)

_LABELS = ["model_name", "engine"]

TTFT = Histogram(PREFIX + "time_to_first_token_seconds",
                 "submitted to the scheduler -> the step carrying the first output token returned",
                 _LABELS, buckets=REQUEST_LATENCY_BUCKETS)
ITL = Histogram(PREFIX + "inter_token_latency_seconds",
                "per request: mean time between consecutive output tokens, observed at finish "
                "(requests with at least two output tokens)", _LABELS,
                buckets=STEP_LATENCY_BUCKETS)
E2E = Histogram(PREFIX + "e2e_request_latency_seconds",
                "submitted to the scheduler -> finished (any finish reason)", _LABELS,
                buckets=REQUEST_LATENCY_BUCKETS)
QUEUE = Histogram(PREFIX + "request_queue_time_seconds",
                  "submitted to the scheduler -> first scheduled into a step", _LABELS,
                  buckets=REQUEST_LATENCY_BUCKETS)
PREFILL = Histogram(PREFIX + "request_prefill_time_seconds",
                    "first scheduled -> first output token", _LABELS, buckets=REQUEST_LATENCY_BUCKETS)
DECODE = Histogram(PREFIX + "request_decode_time_seconds",
                   "first output token -> finished", _LABELS, buckets=REQUEST_LATENCY_BUCKETS)
PROMPT_TOKENS = Counter(PREFIX + "prompt_tokens_total",
                        "prompt tokens of requests that produced a first token", _LABELS)
GENERATION_TOKENS = Counter(PREFIX + "generation_tokens_total", "output tokens sent to gateways",
                            _LABELS)
REQUEST_PROMPT_TOKENS = Histogram(PREFIX + "request_prompt_tokens", "prompt length of finished requests",
                                  _LABELS, buckets=TOKEN_COUNT_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram(PREFIX + "request_generation_tokens",
                                      "output tokens of finished requests", _LABELS,
                                      buckets=TOKEN_COUNT_BUCKETS)
REQUESTS_SUBMITTED = Counter(PREFIX + "engine_requests_submitted_total",
                             "requests submitted over EngineStream", _LABELS)
REQUESTS_FINISHED = Counter(PREFIX + "request_success_total",
                            "finished requests by finish reason (stop, length, abort, error)",
                            [*_LABELS, "finished_reason"])
STEP_DURATION = Histogram(PREFIX + "step_duration_seconds",
                          "time one engine step held the worker pipeline, as the scheduler saw it "
                          "(result received - max(plan sent, previous result received))", _LABELS,
                          buckets=STEP_LATENCY_BUCKETS)
STEP_BATCH_SIZE = Histogram(PREFIX + "step_batch_size", "requests in one engine step", _LABELS,
                            buckets=BATCH_SIZE_BUCKETS)
STEP_TOKENS = Histogram(PREFIX + "step_num_tokens", "tokens computed in one engine step", _LABELS,
                        buckets=TOKEN_COUNT_BUCKETS)


class RequestRecord:
    """One live request's clock readings (monotonic ns) and output count."""

    __slots__ = ("queued_ns", "scheduled_ns", "first_token_ns", "num_output_tokens", "exemplar")

    def __init__(self, queued_ns: int, exemplar: dict | None) -> None:
        self.queued_ns = queued_ns
        self.scheduled_ns = 0
        self.first_token_ns = 0
        self.num_output_tokens = 0
        self.exemplar = exemplar


class EngineMetrics:
    """The metric children of one engine, and the request-lifecycle hooks the adapter calls."""

    def __init__(self, model_name: str, engine_id: str) -> None:
        self.model_name, self.engine_id = model_name, engine_id
        labels = (model_name, engine_id)
        self.ttft, self.itl, self.e2e = TTFT.labels(*labels), ITL.labels(*labels), E2E.labels(*labels)
        self.queue, self.prefill, self.decode = (QUEUE.labels(*labels), PREFILL.labels(*labels),
                                                 DECODE.labels(*labels))
        self.prompt_tokens = PROMPT_TOKENS.labels(*labels)
        self.generation_tokens = GENERATION_TOKENS.labels(*labels)
        self.request_prompt_tokens = REQUEST_PROMPT_TOKENS.labels(*labels)
        self.request_generation_tokens = REQUEST_GENERATION_TOKENS.labels(*labels)
        self.submitted = REQUESTS_SUBMITTED.labels(*labels)
        self.step_duration = STEP_DURATION.labels(*labels)
        self.step_batch_size = STEP_BATCH_SIZE.labels(*labels)
        self.step_tokens = STEP_TOKENS.labels(*labels)
        self._finished = {}
        # Monotonic ns -> Unix-epoch ns for RequestTiming: one offset, so differences stay
        # exact even if the wall clock is stepped while requests run.
        self._unix_offset_ns = time.time_ns() - time.monotonic_ns()

    def finished_counter(self, reason: str):
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = REQUESTS_FINISHED.labels(self.model_name, self.engine_id,
                                                                      reason)
        return child

    # ---- lifecycle hooks (the adapter's loop thread) -------------------------------------
    def on_submit(self, traceparent: str) -> RequestRecord:
        self.submitted.inc()
        return RequestRecord(time.monotonic_ns(), traceparent_exemplar(traceparent) if traceparent else None)

    def on_scheduled(self, rec: RequestRecord, now_ns: int) -> None:
        if rec.scheduled_ns:
            return  # resumed after a preemption: the first scheduling counts
        rec.scheduled_ns = now_ns
        self.queue.observe((now_ns - rec.queued_ns) / 1e9, rec.exemplar)

    def on_first_token(self, rec: RequestRecord, num_prompt_tokens: int, now_ns: int) -> None:
        """(The adapter also sends the first three stamps with this output: a gateway that
        stops the request on a stop string never sees the finishing output.)"""
        rec.first_token_ns = now_ns
        self.ttft.observe((now_ns - rec.queued_ns) / 1e9, rec.exemplar)
        if rec.scheduled_ns:
            self.prefill.observe((now_ns - rec.scheduled_ns) / 1e9, rec.exemplar)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_finished(self, rec: RequestRecord, reason: str, num_prompt_tokens: int,
                    now_ns: int) -> tuple[int, int, int, int]:
        """Observe the finished request; returns its RequestTiming stamps (Unix ns, 0 = never)."""
        ex = rec.exemplar
        self.e2e.observe((now_ns - rec.queued_ns) / 1e9, ex)
        self.finished_counter(reason).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(rec.num_output_tokens)
        if rec.first_token_ns:
            self.decode.observe((now_ns - rec.first_token_ns) / 1e9, ex)
            if rec.num_output_tokens >= 2:
                self.itl.observe((now_ns - rec.first_token_ns) / 1e9 / (rec.num_output_tokens - 1), ex)
        return self.stamps(rec, now_ns)

    def stamps(self, rec: RequestRecord, finished_ns: int = 0) -> tuple[int, int, int, int]:
        """RequestTiming stamps in Unix ns (0 = not reached yet)."""
        off = self._unix_offset_ns
        return (rec.queued_ns + off, rec.scheduled_ns + off if rec.scheduled_ns else 0,
                rec.first_token_ns + off if rec.first_token_ns else 0,
                finished_ns + off if finished_ns else 0)

    def on_step(self, duration_s: float, num_requests: int, num_tokens: int) -> None:
        self.step_duration.observe(duration_s)
        self.step_batch_size.observe(num_requests)
        self.step_tokens.observe(num_tokens)


class _EngineStateCollector:
    """Running / waiting requests, KV usage, prefix-cache and preemption counters, read from
    each registered engine's core at scrape time (the scrape thread only reads)."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, str], object] = {}   # (model_name, engine id) -> Engine

    def describe(self):
        return []  # families appear once an engine registers

    def collect(self):
        running = GaugeMetricFamily(PREFIX + "num_requests_running", "requests in the running batch",
                                    labels=_LABELS)
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "requests queued for their first "
                                    "(or, after preemption, next) step", labels=_LABELS)
        kv = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "fraction of KV blocks in use (0..1)",
                               labels=_LABELS)
        blocks = GaugeMetricFamily(PREFIX + "kv_cache_num_blocks", "KV blocks of the engine",
                                   labels=_LABELS)
        queries = CounterMetricFamily(PREFIX + "prefix_cache_queries", "prompt tokens looked up in the "
                                      "prefix cache", labels=_LABELS)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hits", "looked-up prompt tokens found cached",
                                   labels=_LABELS)
        preemptions = CounterMetricFamily(PREFIX + "num_preemptions", "requests preempted (KV recompute)",
                                          labels=_LABELS)
        steps = CounterMetricFamily(PREFIX + "engine_steps", "engine steps completed", labels=_LABELS)
        # KV tiers (docs/kv_tiers.md): prompt blocks served from tier 1 (host) and tier 2 (kvstore).
        tier_labels = [*_LABELS, "tier"]
        tier_hits = CounterMetricFamily(PREFIX + "kv_tier_prefix_hit_blocks", "prompt blocks not recomputed "
                                        "because a KV tier held them", labels=tier_labels)
        tier_misses = CounterMetricFamily(PREFIX + "kv_tier_prefix_miss_blocks", "blocks a lookup found whose "
                                          "fetch failed or timed out (recomputed)", labels=tier_labels)
        tier_saved = CounterMetricFamily(PREFIX + "kv_tier_stored_blocks", "blocks sent to a tier (host: "
                                         "evicted device blocks kept; kvstore: prompt blocks saved)", labels=tier_labels)
        lookups = CounterMetricFamily(PREFIX + "kv_tier_lookups", "kvstore lookups of prompts this engine did "
                                      "not hold whole", labels=_LABELS)
        loading = GaugeMetricFamily(PREFIX + "num_requests_loading_kv", "requests waiting for a kvstore lookup "
                                    "or fetch", labels=_LABELS)
        host_blocks = GaugeMetricFamily(PREFIX + "kv_tier_host_blocks", "blocks in the worker's host pool",
                                        labels=_LABELS)
        direct_failed = CounterMetricFamily(PREFIX + "kv_handoff_direct_failed", "direct hand-offs that did not "
                                            "arrive whole, by what followed (kvstore: looked up there; recompute; "
                                            "error: --kv-load-failure-policy fail)", labels=[*_LABELS, "then"])
        for labels, engine in list(self.engines.items()):
            core = getattr(engine, "core", None)
            if core is None:
                continue
            labels = list(labels)
            st = core.stats()
            running.add_metric(labels, st["num_running"])
            waiting.add_metric(labels, st["num_waiting"])
            kv.add_metric(labels, st["kv_usage"])
            blocks.add_metric(labels, core.pool.num_blocks)
            queries.add_metric(labels, st["prefix_cache_queries"])
            hits.add_metric(labels, st["prefix_cache_hits"])
            preemptions.add_metric(labels, st["num_preemptions"])
            steps.add_metric(labels, engine.steps)
            tier_hits.add_metric([*labels, "host"], st["host_hit_blocks"])
            tier_hits.add_metric([*labels, "kvstore"], st["kvstore_loaded_blocks"])
            tier_misses.add_metric([*labels, "kvstore"], st["kvstore_failed_blocks"])
            tier_saved.add_metric([*labels, "host"], core.kv.host.stored if core.kv.host is not None else 0)
            tier_saved.add_metric([*labels, "kvstore"], st["kvstore_saved_blocks"])
            lookups.add_metric(labels, st["kvstore_lookups"])
            loading.add_metric(labels, len(core.lookups) + len(core.loading))
            host_blocks.add_metric(labels, st["host_tier_blocks"])
            for then in ("kvstore", "recompute", "error"):
                direct_failed.add_metric([*labels, then], st[f"direct_failed_{then}"])
        return [running, waiting, kv, blocks, queries, hits, preemptions, steps, tier_hits, tier_misses, tier_saved,
                lookups, loading, host_blocks, direct_failed]


ENGINE_STATE = _EngineStateCollector()
REGISTRY.register(ENGINE_STATE)
