"""The scheduler's spans of a traced request, at a fixed cost per request and none per step.

`scheduler.request` opens when the submit arrives (its id must exist before the request is
scheduled: it becomes the parent the worker receives in NewRequest.trace) and closes at
the finishing output. Its phases are written at finish from the request's timing stamps
(queued, first scheduled, first token, finished), which the adapter records anyway:

    scheduler.request  ├ scheduler.queue     queued -> first scheduled
                       ├ scheduler.prefill   first scheduled -> first token
                       └ scheduler.decode    first token -> finished

plus the events `scheduled`, `first_token` and `finished` on the request span. A request
without a sampled TraceContext costs one attribute test."""
from __future__ import annotations

import time

from services.common import pb, telemetry

MAX_OPEN = 65536  # bounds the map if outputs were ever lost (every finish pops its entry)


class RequestTraces:
    def __init__(self) -> None:
        self._open: dict[str, object] = {}   # request id -> its scheduler.request span

    def __len__(self) -> int:
        return len(self._open)

    def on_submit(self, request) -> None:
        """Open the request span under the caller's context and hand the worker ours."""
        trace = request.trace
        if not trace.traceparent or len(self._open) >= MAX_OPEN:
            return
        span = telemetry.start_span(
            "scheduler.request", traceparent=trace.traceparent, tracestate=trace.tracestate,
            kind="consumer", attributes={"meshllm.request_id": request.request_id,
                                         "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                                         "gen_ai.request.max_tokens": int(request.max_tokens),
                                         "meshllm.priority": int(request.priority)})
        if span is None:
            return
        old = self._open.pop(request.request_id, None)
        if old is not None:  # a reused id whose first run never finished here
            telemetry.end_span(old, error="replaced")
        self._open[request.request_id] = span
        tp, ts = telemetry.traceparent_of(span)
        request.trace = pb.common.TraceContext(traceparent=tp, tracestate=ts)

    def on_finished(self, out, num_output_tokens: int) -> None:
        """`out`: the request's finishing RequestOutput (timing stamps set by the adapter)."""
        span = self._open.pop(out.request_id, None)
        if span is None:
            return
        queued, scheduled, first, finished = out.timing or (0, 0, 0, 0)
        finished = finished or time.time_ns()
        phases = (("scheduler.queue", queued, scheduled or finished, "scheduled"),
                  ("scheduler.prefill", scheduled, first or finished, "first_token"),
                  ("scheduler.decode", first, finished, None))
        for name, start, end, event in phases:
            if not start:
                continue
            telemetry.end_span(telemetry.start_span(name, parent=span, start_ns=start), end_ns=max(start, end))
            if event and end != finished:
                telemetry.add_event(span, event, ts_ns=end)
        telemetry.add_event(span, "finished", {"meshllm.finish_reason": str(out.finish_reason)}, ts_ns=finished)
        attrs = {"gen_ai.usage.output_tokens": int(num_output_tokens),
                 "meshllm.finish_reason": str(out.finish_reason),
                 "meshllm.num_cached_tokens": int(out.num_cached_tokens)}
        if getattr(out, "spec_draft_tokens", 0):   # speculative decoding: what it drafted and kept
            attrs["meshllm.spec.draft_tokens"] = int(out.spec_draft_tokens)
            attrs["meshllm.spec.accepted_tokens"] = int(out.spec_accepted_tokens)
        error = f"{out.error_code}" if out.finish_reason == "error" else None
        telemetry.end_span(span, end_ns=finished, attributes=attrs, error=error)

    def on_tier(self, request_id: str, name: str, start_ns: int, end_ns: int, attributes: dict) -> None:
        """A KV-tier phase of a traced request (kv.lookup, kv.load, kv.save) as a child span."""
        span = self._open.get(request_id)
        if span is not None:
            telemetry.end_span(telemetry.start_span(name, parent=span, start_ns=start_ns, attributes=attributes),
                               end_ns=max(start_ns, end_ns))

    def close_all(self) -> None:
        """The engine is stopping: end what is still open."""
        spans, self._open = list(self._open.values()), {}
        for span in spans:
            telemetry.end_span(span, error="engine stopped")
