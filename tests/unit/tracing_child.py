"""Run by tests/unit/test_tracing.py in a child process (tracing is process-wide state):
`python -m tests.unit.tracing_child ENDPOINT` exports its spans to ENDPOINT and prints a
JSON summary of what it could see locally."""
from __future__ import annotations

import json
import sys

from services.common import pb, telemetry
from services.worker.step_tracing import StepTracer


def _plan(step_id, new=(), cached=(), finished=()):
    return pb.step.StepPlan(step_id=step_id, new_requests=list(new), cached_requests=list(cached),
                            finished_ids=list(finished))


def _result(step_id, outputs):
    return pb.step.StepResult(step_id=step_id, forward_ns=1_000_000, outputs=[
        pb.step.SampledOutput(request_id=rid, token_ids=ids) for rid, ids in outputs])


def main(endpoint: str) -> None:
    telemetry.init_tracing("unit", endpoint, sampling_ratio=1.0, schedule_delay_ms=50)
    out = {}
    roots = [telemetry.start_span("ratio1", root=True) for _ in range(10)]
    out["ratio1_sampled"] = sum(s is not None for s in roots)
    out["previous_ratio"] = telemetry.set_trace_sampling_ratio(0.0)
    out["ratio0_sampled"] = sum(telemetry.start_span("ratio0", root=True) is not None for _ in range(10))
    # Parent-based: a sampled parent keeps its children sampled whatever the ratio.
    child = telemetry.start_span("child", traceparent=telemetry.traceparent_of(roots[0])[0])
    out["child_sampled"] = child is not None
    # Below the gateway nothing starts a trace of its own.
    out["orphan"] = telemetry.start_span("orphan") is not None
    out["unsampled_parent"] = telemetry.start_span(
        "x", traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00") is not None
    out["malformed_parent"] = telemetry.start_span("x", traceparent="garbage") is not None
    telemetry.set_trace_sampling_ratio(0.5)
    out["half_sampled"] = sum(telemetry.start_span("half", root=True) is not None for _ in range(4000))
    telemetry.set_trace_sampling_ratio(1.0)
    for s in (*roots, child):
        telemetry.end_span(s)

    parent = telemetry.start_span("sched", root=True)
    tp = telemetry.traceparent_of(parent)[0]
    out["sched_span_id"] = format(parent.get_span_context().span_id, "016x")
    trace = pb.common.TraceContext(traceparent=tp)
    tracer = StepTracer(decode_step_interval=4, max_step_spans=2)
    # r1: a 40-token prompt in three chunks, then 10 decode steps; "u" (untraced) rides along.
    tracer.on_step(_plan(1, new=[pb.step.NewRequest(request_id="r1", token_ids=[1] * 40, trace=trace),
                                 pb.step.NewRequest(request_id="u", token_ids=[1] * 4)]),
                   _result(1, [("r1", []), ("u", [7])]), 1_000, 2_000)
    tracer.on_step(_plan(2), _result(2, [("r1", []), ("u", [7])]), 3_000, 4_000)
    tracer.on_step(_plan(3), _result(3, [("r1", [5]), ("u", [7])]), 5_000, 6_000)
    for i in range(10):
        tracer.on_step(_plan(4 + i), _result(4 + i, [("r1", [5]), ("u", [7])]), 10_000 * (i + 1), 10_000 * (i + 1) + 500)
    # Five traced one-token prompts at once: five prefills, then a step cap of two decode spans.
    new = [pb.step.NewRequest(request_id=f"b{i}", token_ids=[1], trace=trace) for i in range(5)]
    tracer.on_step(_plan(20, new=new), _result(20, [(f"b{i}", [3]) for i in range(5)]), 200_000, 201_000)
    tracer.on_step(_plan(21), _result(21, [(f"b{i}", [3]) for i in range(5)]), 202_000, 203_000)
    out["resident_before_finish"] = len(tracer)
    tracer.on_step(_plan(22, finished=["r1", "u", *(f"b{i}" for i in range(5))]), _result(22, []), 204_000, 205_000)
    out["resident_after_finish"] = len(tracer)
    telemetry.end_span(parent)
    telemetry.shutdown_tracing()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
