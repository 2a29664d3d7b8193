"""One trace per request across gateway -> tokenizer -> scheduler -> worker, collected by a
real OTLP/gRPC receiver from a real mesh (`meshllm serve --otlp-traces-endpoint`)."""
from __future__ import annotations

import json
import os
import secrets
import urllib.request

import grpc
import pytest

from services.common import pb
from tests.integration.meshproc import start_mesh
from tests.integration.otlp_receiver import OtlpReceiver

PROMPT_MARKER = "Zanzibar-quartz-7"  # must never appear in any span


@pytest.fixture(scope="module")
def traced(smollm2_dir):
    rx = OtlpReceiver()
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s of a span's end
    try:
        mesh = start_mesh(str(smollm2_dir), "--otlp-traces-endpoint", rx.endpoint)
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
    try:
        yield mesh, rx
    finally:
        mesh.stop()
        rx.close()


def _chat(mesh, http_request_id: str, headers: dict | None = None, max_tokens: int = 6) -> dict:
    body = json.dumps({"model": mesh.model_name, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": f"Say hello. {PROMPT_MARKER}"}]}).encode()
    req = urllib.request.Request(f"{mesh.http_url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-request-id": http_request_id,
                                          **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _complete_trace(rx: OtlpReceiver, engine_request_id: str, timeout_s: float = 30.0):
    """Wait until every service's spans of one request are in; returns the whole trace."""
    def done(spans) -> bool:
        mine = [s for s in spans if s.attributes.get("meshllm.request_id") == engine_request_id]
        names = {s.name for s in mine}
        if not {"scheduler.request", "worker.prefill", "tokenizer.detokenize"} <= names:
            return False
        trace = {s.name for s in spans if s.trace_id == mine[0].trace_id}
        return {"scheduler.decode", "worker.decode_step"} <= trace and any(
            s.service == "meshllm-gateway" for s in spans if s.trace_id == mine[0].trace_id)
    rx.wait_for(done, timeout_s)
    tid = next(s.trace_id for s in rx.spans if s.attributes.get("meshllm.request_id") == engine_request_id)
    return rx.trace(tid)


def _one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def test_one_trace_links_gateway_tokenizer_scheduler_worker(traced):
    mesh, rx = traced
    out = _chat(mesh, "trace-http-1", max_tokens=6)
    spans = _complete_trace(rx, out["id"])

    root = _one(spans, "POST /v1/chat/completions")
    assert root.service == "meshllm-gateway" and root.parent_span_id == ""
    assert root.attributes["meshllm.http_request_id"] == "trace-http-1"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == out["usage"]["completion_tokens"]

    template = _one(spans, "tokenizer.chat_template")
    detok = _one(spans, "tokenizer.detokenize")
    sched = _one(spans, "scheduler.request")
    prefill = _one(spans, "worker.prefill")
    assert (template.service, detok.service) == ("meshllm-tokenizer", "meshllm-tokenizer")
    assert sched.service == "meshllm-scheduler" and prefill.service == "meshllm-worker"
    # The parent chain crosses gRPC metadata, the Detokenize stream, EngineSubmit and the
    # ZMQ StepPlan: gateway -> tokenizer / scheduler -> worker.
    assert template.parent_span_id == root.span_id
    assert detok.parent_span_id == root.span_id
    assert sched.parent_span_id == root.span_id
    assert prefill.parent_span_id == sched.span_id
    for phase in ("scheduler.queue", "scheduler.prefill", "scheduler.decode"):
        assert _one(spans, phase).parent_span_id == sched.span_id
    step = _one(spans, "worker.decode_step")  # 5 decode steps, one span per 32
    assert step.parent_span_id == sched.span_id and step.attributes["meshllm.steps_since_first_token"] == 1
    assert prefill.attributes["meshllm.prefill_chunks"] == 1 and prefill.end_ns <= step.start_ns

    # One trace id, every parent inside the trace, children within their parents' time.
    by_id = {s.span_id: s for s in spans}
    assert len({s.trace_id for s in spans}) == 1
    for s in spans:
        assert s is root or s.parent_span_id in by_id, (s.service, s.name)  # root: parent ""
        assert s.end_ns >= s.start_ns
    assert sched.attributes["gen_ai.usage.output_tokens"] == out["usage"]["completion_tokens"]
    assert detok.attributes["meshllm.detokenize.finished"] is True
    # Never the prompt (or output) text.
    for s in spans:
        for value in s.attributes.values():
            assert PROMPT_MARKER not in str(value)


def test_client_traceparent_is_followed_and_unsampled_request_leaves_no_spans(traced):
    mesh, rx = traced
    # An unsampled caller (flags 00): no span anywhere for this request.
    quiet_trace = secrets.token_hex(16)
    quiet = _chat(mesh, "trace-quiet", {"traceparent": f"00-{quiet_trace}-{secrets.token_hex(8)}-00"}, 3)
    # A sampled caller over the public gRPC API: the trace continues the caller's.
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        responses = list(stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text=f"Once upon a time {PROMPT_MARKER}", request_id="trace-grpc-1",
            sampling=pb.common.SamplingParams(max_tokens=3)),
            metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),), timeout=120))
    assert responses[-1].finish_reason
    spans = _complete_trace(rx, "trace-grpc-1")
    root = _one(spans, "meshllm.v1.Generation/Generate")
    assert root.trace_id == trace_id and root.parent_span_id == parent
    assert _one(spans, "tokenizer.encode").parent_span_id == root.span_id
    assert _one(spans, "scheduler.request").parent_span_id == root.span_id
    # Each service exports in the order its spans end, and the quiet request finished in
    # every service before the sampled one began: its spans would have arrived by now.
    assert not [s for s in rx.spans if s.trace_id == quiet_trace]
    assert not [s for s in rx.spans if s.attributes.get("meshllm.request_id") == quiet["id"]]
    assert not [s for s in rx.spans if s.attributes.get("meshllm.http_request_id") == "trace-quiet"]


def test_kv_tier_lookup_and_save_are_spans_of_the_request(traced):
    """The mesh's engine uses the kvstore (meshllm serve starts one): a prompt it has never seen
    whole is looked up there (at most the chat template's first block, shared with earlier
    requests, is found) and its new full blocks are saved, both under scheduler.request."""
    mesh, rx = traced
    words = " ".join(f"item{i}" for i in range(120))
    body = json.dumps({"model": mesh.model_name, "max_tokens": 3,
                       "messages": [{"role": "user", "content": f"List these: {words}"}]}).encode()
    req = urllib.request.Request(f"{mesh.http_url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    spans = _complete_trace(rx, out["id"])
    sched = _one(spans, "scheduler.request")
    lookup = _one(spans, "kv.lookup")
    full = out["usage"]["prompt_tokens"] // 16
    assert lookup.parent_span_id == sched.span_id and lookup.attributes["meshllm.kv.blocks_found"] <= 2
    saves = [s for s in spans if s.name == "kv.save"]
    assert saves and all(s.parent_span_id == sched.span_id for s in saves)
    assert full - 2 <= sum(s.attributes["meshllm.kv.blocks"] for s in saves) <= full
    assert sched.start_ns <= lookup.start_ns <= lookup.end_ns <= sched.end_ns
