"""Worker spans of traced requests, at a bounded cost per step.

A request is traced when its NewRequest carries a sampled TraceContext (the scheduler's
`scheduler.request` span). Under that span the worker writes:

- `worker.prefill`: from the first step that carried the request to the step that sampled
  its first token (all its prompt chunks; a preempted request that resumes gets another,
  with `meshllm.resumed` set).
- `worker.decode_step`: the request's first decode step, then one every
  `decode_step_interval` worker steps, each covering that whole batched step (batch size,
  forward time); at most `max_step_spans` such spans in one step across all requests (a
  request whose sample finds the step full skips it and waits for its next interval).

Every span ends at a step the worker runs, so it is exported at once; there is no
per-request span waiting for the plan that drops the request's state (that plan may come
only with the next request). The per-request entry is dropped with `finished_ids`, as the
runner drops its own state.

Cost per step: one truthiness test while no traced request is resident. Otherwise the
step's outputs are scanned (one dict lookup each) only on steps where a traced request is in
prefill or has a decode span due; on other steps the cost is a dict pop.

Plans and results are the worker's values (plan.py); a NewRequest's `trace` is None when the
request is not traced. Spans per step: traced requests finishing
prefill plus at most `max_step_spans`.
"""
from __future__ import annotations

from services.common import telemetry

MAX_RESIDENT = 65536  # bounds the map if a scheduler never sent finished ids


class _Traced:
    __slots__ = ("request_id", "traceparent", "tracestate", "first_ns", "chunks", "first_token_step",
                 "attributes")

    def __init__(self, nr, trace, first_ns: int) -> None:
        self.request_id = nr.request_id
        self.traceparent, self.tracestate = trace.traceparent, trace.tracestate
        self.first_ns = first_ns
        self.chunks = 0
        self.first_token_step = 0  # the worker step that sampled its first token; 0: in prefill
        self.attributes = {"meshllm.request_id": nr.request_id, "meshllm.num_tokens": len(nr.token_ids),
                           "meshllm.num_computed_tokens": int(nr.num_computed_tokens),
                           "meshllm.resumed": nr.num_output_tokens > 0}

    def child(self, name: str, start_ns: int, end_ns: int, attributes: dict) -> None:
        span = telemetry.start_span(name, traceparent=self.traceparent, tracestate=self.tracestate,
                                    start_ns=start_ns, attributes=attributes)
        telemetry.end_span(span, end_ns=end_ns)


class StepTracer:
    def __init__(self, decode_step_interval: int = 32, max_step_spans: int = 4) -> None:
        if decode_step_interval < 1 or max_step_spans < 0:
            raise ValueError("decode_step_interval must be >= 1 and max_step_spans >= 0")
        self.decode_step_interval = decode_step_interval
        self.max_step_spans = max_step_spans
        self._resident: dict[str, _Traced] = {}
        self._prefilling: dict[str, _Traced] = {}
        self._due: dict[int, list[_Traced]] = {}   # worker step -> requests whose decode span is due
        self._step = 0

    def __len__(self) -> int:
        return len(self._resident)

    def on_step(self, plan, result, start_ns: int, end_ns: int) -> None:
        """After a step ran: `plan` (StepPlan), `result` (StepResult), wall-clock ns."""
        self._step += 1
        resident = self._resident
        if resident:
            for rid in plan.finished_ids:  # dropped before this step ran, as in the runner
                if resident.pop(rid, None) is not None:
                    self._prefilling.pop(rid, None)
        for nr in plan.new_requests:
            trace = nr.trace
            if trace is not None and trace.traceparent and len(resident) < MAX_RESIDENT:
                resident[nr.request_id] = self._prefilling[nr.request_id] = _Traced(nr, trace, start_ns)
        if not resident:
            self._due.clear()
            return
        due = self._due.pop(self._step, None)
        if not self._prefilling and not due:
            return
        wanted = dict(self._prefilling)
        for t in due or ():
            if resident.get(t.request_id) is t:  # still here (not finished or resumed since)
                wanted[t.request_id] = t
        ran: dict[str, bool] = {}                 # request id -> sampled a token this step
        get = wanted.get
        for out in result.outputs:
            if get(out.request_id) is not None:
                ran[out.request_id] = bool(out.token_ids)
        batch = len(plan.new_requests) + len(plan.cached_requests)
        step_spans = 0
        for rid, t in wanted.items():
            sampled = ran.get(rid)
            if not t.first_token_step:
                if sampled is None:
                    continue  # not in this step
                t.chunks += 1
                if sampled:  # the prompt's last chunk ran: prefill is over
                    t.first_token_step = self._step
                    del self._prefilling[rid]
                    t.child("worker.prefill", t.first_ns, end_ns, {**t.attributes, "meshllm.prefill_chunks": t.chunks})
                    self._schedule(t, self._step + 1)
                continue
            if sampled is None:  # not in this step: take its next one
                self._schedule(t, self._step + 1)
                continue
            if step_spans >= self.max_step_spans:  # the step is full: skip this sample
                self._schedule(t, self._step + self.decode_step_interval)
                continue
            step_spans += 1
            t.child("worker.decode_step", start_ns, end_ns, {
                "meshllm.request_id": rid, "meshllm.step_id": int(plan.step_id), "meshllm.batch_size": batch,
                "meshllm.steps_since_first_token": self._step - t.first_token_step,
                "meshllm.forward_ms": result.forward_ns / 1e6})
            self._schedule(t, self._step + self.decode_step_interval)

    def _schedule(self, t: _Traced, step: int) -> None:
        self._due.setdefault(step, []).append(t)

    def close_all(self) -> None:
        self._resident.clear()
        self._prefilling.clear()
        self._due.clear()
