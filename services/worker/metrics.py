"""The worker's Prometheus metrics: one update per step (never per token), from the
engine thread; labels `model_name` and `engine` like the scheduler's."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.common.metrics import PREFIX, STEP_LATENCY_BUCKETS

_LABELS = ["model_name", "engine"]

STEPS = Counter(PREFIX + "worker_steps_total", "StepPlans executed", _LABELS)
STEP_ERRORS = Counter(PREFIX + "worker_step_errors_total", "StepPlans that failed (their requests fail)",
                      _LABELS)
FORWARD = Histogram(PREFIX + "worker_step_duration_seconds",
                    "time the worker spent executing one StepPlan (forward pass and sampling)",
                    _LABELS, buckets=STEP_LATENCY_BUCKETS)
TOKENS = Counter(PREFIX + "worker_scheduled_tokens_total", "tokens computed (prompt and decode)", _LABELS)
SAMPLED = Counter(PREFIX + "worker_sampled_tokens_total", "tokens sampled", _LABELS)
# Structured outputs (structured.py observes them from the runner, which knows no engine id).
MATCHER_BUILD = Histogram(PREFIX + "worker_structured_matcher_build_seconds",
                          "time to build one grammar matcher (a grammar not in the template cache)",
                          ["model_name"], buckets=STEP_LATENCY_BUCKETS)
GRAMMAR_CACHE = Counter(PREFIX + "worker_structured_grammar_cache_total",
                        "constrained requests whose grammar was already built (hit) or was compiled (miss)",
                        ["model_name", "result"])
# Speculative decoding (spec/decoder.py): draft tokens verified and accepted, steps that verified any.
SPEC_DRAFTED = Counter(PREFIX + "worker_spec_draft_tokens_total", "draft tokens verified",
                       ["model_name", "method"])
SPEC_ACCEPTED = Counter(PREFIX + "worker_spec_accepted_tokens_total", "draft tokens accepted",
                        ["model_name", "method"])
SPEC_STEPS = Counter(PREFIX + "worker_spec_steps_total", "steps that verified draft tokens",
                     ["model_name", "method"])
SPEC_FED_STEPS = Counter(PREFIX + "worker_spec_device_fed_steps_total",
                         "speculative steps fed from the device (drafts proposed without a host sync)",
                         ["model_name", "method"])
SPEC_ROWS = Counter(PREFIX + "worker_spec_verified_rows_total",
                    "request rows that verified drafts (mean accepted length = 1 + accepted / rows)",
                    ["model_name", "method"])
SPEC_DRAFTED_AT = Counter(PREFIX + "worker_spec_draft_tokens_per_position_total",
                          "draft tokens verified at each draft position (1: a row's first draft)",
                          ["model_name", "method", "position"])
SPEC_ACCEPTED_AT = Counter(PREFIX + "worker_spec_accepted_tokens_per_position_total",
                           "draft tokens accepted at each draft position (acceptance per position = this / "
                           "the drafted count at the same position)", ["model_name", "method", "position"])
MASK_PER_ROW = Histogram(PREFIX + "worker_structured_mask_seconds_per_row",
                         "host time to compute one constrained row's token mask, averaged over a step",
                         ["model_name"], buckets=STEP_LATENCY_BUCKETS)


class WorkerMetrics:
    def __init__(self, model_name: str, engine_id: str) -> None:
        labels = (model_name, engine_id)
        self.steps, self.errors = STEPS.labels(*labels), STEP_ERRORS.labels(*labels)
        self.forward, self.tokens, self.sampled = (FORWARD.labels(*labels), TOKENS.labels(*labels),
                                                   SAMPLED.labels(*labels))

    def on_step(self, forward_ns: int, num_tokens: int, num_sampled: int, failed: bool) -> None:
        self.steps.inc()
        self.forward.observe(forward_ns / 1e9)
        if num_tokens:
            self.tokens.inc(num_tokens)
        if num_sampled:
            self.sampled.inc(num_sampled)
        if failed:
            self.errors.inc()
