"""How much work an abort failed to stop: output tokens the worker produced for a request
after its abort reached the scheduler.

Those can only come from steps already planned when the abort arrived (the adapter applies
aborts before planning the next step): the step running on the worker and, with async
scheduling, the one queued behind it. So per aborted request the count stays at most
1 token (synchronous scheduling) or 2 (async), times the tokens one step adds per request.
Entries live until the results of every step that could hold the request came back, plus
the same margin again so a request that kept running would be caught, not forgotten.

Pure bookkeeping (no I/O); exposed as `meshllm:tokens_after_abort_total` and in GetLoad."""
from __future__ import annotations

from collections.abc import Container, Iterable

from prometheus_client import Counter

from services.common.metrics import PREFIX

TOKENS_AFTER_ABORT = Counter(PREFIX + "tokens_after_abort",
                             "output tokens the worker produced for requests after their abort "
                             "reached the scheduler (bounded by the steps already in flight)",
                             ["engine"])
ABORTS = Counter(PREFIX + "engine_aborts", "aborts of live requests that reached the scheduler",
                 ["engine"])


class AbortTracker:
    def __init__(self, engine_id: str = "", pipeline_depth: int = 2) -> None:
        self.pipeline_depth = pipeline_depth
        self.tokens_after_abort = 0
        self.aborts = 0
        self._last_planned = -1
        self._watch: dict[str, int] = {}   # request id -> last step id that might hold it
        self._tokens = TOKENS_AFTER_ABORT.labels(engine_id)
        self._aborts = ABORTS.labels(engine_id)

    def on_plan(self, step_id: int) -> None:
        self._last_planned = step_id

    def on_abort(self, request_ids: Iterable[str], live: Container[str]) -> None:
        """The abort message arrived (before the loop applies it). `live`: requests the
        core still holds (aborts of finished requests cost nothing and are not counted)."""
        horizon = self._last_planned + self.pipeline_depth
        for rid in request_ids:
            if rid in live and rid not in self._watch:
                self._watch[rid] = horizon
                self.aborts += 1
                self._aborts.inc()

    def on_result(self, step_id: int, sampled) -> None:
        """`sampled`: the step's outputs (objects with request_id and token_ids)."""
        if not self._watch:
            return
        n = 0
        for s in sampled:
            if s.request_id in self._watch:
                n += len(s.token_ids)
        if n:
            self.tokens_after_abort += n
            self._tokens.inc(n)
        done = [rid for rid, last in self._watch.items() if step_id >= last]
        for rid in done:
            del self._watch[rid]
