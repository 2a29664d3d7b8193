"""services/common/metrics.py and the per-service metric pieces that need no mesh."""
from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from services.common import pb
from services.common.grpc_server import bind, make_server
from services.common.metrics import (REGISTRY, check_metrics_config, exposition, start_metrics_server,
                                     traceparent_exemplar)
from services.gateway.http.metrics import UNMATCHED_ROUTE, RouteNames
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.timing import HandleTiming, RequestTimer
from services.scheduler.metrics import EngineMetrics

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_traceparent_exemplar_only_for_sampled_well_formed_traces():
    assert traceparent_exemplar(f"00-{TRACE}-00f067aa0ba902b7-01") == {"trace_id": TRACE}
    assert traceparent_exemplar(f"00-{TRACE}-00f067aa0ba902b7-00") is None   # not sampled
    assert traceparent_exemplar(f"00-{'0' * 32}-00f067aa0ba902b7-01") is None
    for bad in ("", "garbage", f"00-{TRACE[:-1]}-00f067aa0ba902b7-01", f"00-{'x' * 32}-00f067aa0ba902b7-01"):
        assert traceparent_exemplar(bad) is None


def test_openmetrics_keeps_colons_and_carries_exemplars():
    registry = CollectorRegistry()
    h = Histogram("meshllm:unit_latency_seconds", "test", ["engine"], registry=registry)
    h.labels("0").observe(0.2, {"trace_id": TRACE})
    body, content_type = exposition("application/openmetrics-text; version=1.0.0; q=0.5,text/plain;q=0.1",
                                    registry)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert "meshllm_unit" not in text
    fam = {f.name: f for f in parse_openmetrics(text)}["meshllm:unit_latency_seconds"]
    exemplars = [s.exemplar for s in fam.samples if s.exemplar is not None]
    assert [e.labels for e in exemplars] == [{"trace_id": TRACE}]
    body, content_type = exposition(None, registry)
    assert content_type.startswith("text/plain; version=0.0.4")
    names = {s.name for f in parse_prometheus(body.decode()) for s in f.samples}
    assert "meshllm:unit_latency_seconds_count" in names and not any(n.endswith("_created") for n in names)


def test_metrics_server_serves_metrics_and_nothing_else():
    from services.common.ports import free_port
    assert start_metrics_server("127.0.0.1", 0) is None   # 0 = off
    port = start_metrics_server("127.0.0.1", free_port())
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert r.read().decode().endswith("# EOF\n")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
    assert info.value.code == 404
    with pytest.raises(SystemExit):
        start_metrics_server("127.0.0.1", port)   # taken: a clear exit, not a traceback


def test_metrics_flags_are_validated():
    check_metrics_config(0, "0")
    check_metrics_config(9102, "dp-1.a_b")
    for port, engine in ((-1, "0"), (70000, "0"), (0, ""), (0, "a b"), (0, "x" * 65)):
        with pytest.raises(ValueError):
            check_metrics_config(port, engine)


def test_grpc_calls_are_counted_by_method_and_status():
    service = f"unit{time.monotonic_ns()}"

    async def ok(request, context):
        return b"ok"

    async def missing(request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    async def broken(request, context):
        raise RuntimeError("bug")

    async def stream(request, context):
        yield b"1"
        yield b"2"

    async def run() -> None:
        server, _ = make_server(service, [])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("unit.S", {
            "Ok": grpc.unary_unary_rpc_method_handler(ok),
            "Missing": grpc.unary_unary_rpc_method_handler(missing),
            "Broken": grpc.unary_unary_rpc_method_handler(broken),
            "Stream": grpc.unary_stream_rpc_method_handler(stream)}),))
        port = bind(server, "127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for _ in range(2):
                assert await ch.unary_unary("/unit.S/Ok")(b"") == b"ok"
            for method, code in (("Missing", grpc.StatusCode.NOT_FOUND), ("Broken", grpc.StatusCode.UNKNOWN)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary(f"/unit.S/{method}")(b"")
                assert info.value.code() == code
            assert [m async for m in ch.unary_stream("/unit.S/Stream")(b"")] == [b"1", b"2"]
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        await server.stop(None)

    asyncio.run(run())
    counts = {(m, c): value("meshllm:grpc_server_requests_total", service=service, method=m, code=c)
              for m, c in (("Ok", "OK"), ("Missing", "NOT_FOUND"), ("Broken", "UNKNOWN"), ("Stream", "OK"))}
    assert counts == {("Ok", "OK"): 2, ("Missing", "NOT_FOUND"): 1, ("Broken", "UNKNOWN"): 1, ("Stream", "OK"): 1}
    assert value("meshllm:grpc_server_handling_seconds_count", service=service, method="Ok") == 2
    assert value("meshllm:grpc_server_requests_total", service=service, method="Check", code="OK") == 0


def test_route_names_are_bounded_templates():
    from fastapi import FastAPI
    app = FastAPI()

    @app.get("/v1/models/{model:path}")
    async def one(model: str):
        return {}

    @app.post("/v1/completions")
    async def completions():
        return {}

    names = RouteNames(app.routes)
    assert names("/v1/completions") == "/v1/completions"
    assert names("/v1/models/some/model") == "/v1/models/{model:path}"
    assert names("/v1/../etc/passwd") == UNMATCHED_ROUTE == names("/anything-else")


def test_engine_metrics_observe_each_phase_once_and_stamp_in_order():
    engine_id = f"unit-{time.monotonic_ns()}"
    m = EngineMetrics("unit-model", engine_id)
    labels = {"model_name": "unit-model", "engine": engine_id}
    rec = m.on_submit(f"00-{TRACE}-00f067aa0ba902b7-01")
    assert rec.exemplar == {"trace_id": TRACE}
    t0 = rec.queued_ns
    m.on_scheduled(rec, t0 + 1_000_000)
    m.on_scheduled(rec, t0 + 9_000_000)   # resumed after preemption: not a second queue time
    m.on_first_token(rec, 7, t0 + 5_000_000)
    rec.num_output_tokens = 5
    stamps = m.on_finished(rec, "length", 7, t0 + 13_000_000)
    queued, scheduled, first, finished = stamps
    assert (scheduled - queued, first - queued, finished - queued) == (1_000_000, 5_000_000, 13_000_000)
    assert abs(queued / 1e9 - time.time()) < 60   # Unix-epoch nanoseconds
    assert value("meshllm:request_queue_time_seconds_count", **labels) == 1
    assert value("meshllm:request_queue_time_seconds_sum", **labels) == pytest.approx(0.001)
    assert value("meshllm:time_to_first_token_seconds_sum", **labels) == pytest.approx(0.005)
    assert value("meshllm:inter_token_latency_seconds_sum", **labels) == pytest.approx(0.008 / 4)
    assert value("meshllm:prompt_tokens_total", **labels) == 7
    assert value("meshllm:request_success_total", finished_reason="length", **labels) == 1
    m.on_step(0.01, 3, 40)
    assert value("meshllm:step_num_tokens_sum", **labels) == 40


def test_timing_breakdown_from_scheduler_stamps_and_gateway_clock():
    timer = RequestTimer()
    timer.tokenize_ns = 2_000_000
    ht = HandleTiming()
    base = time.time_ns()
    stamps = pb.engine.RequestTiming(queued_unix_ns=base, first_scheduled_unix_ns=base + 1_000_000,
                                     first_token_unix_ns=base + 4_000_000, finished_unix_ns=base + 10_000_000)
    out = pb.engine.RequestOutput(request_id="r", new_token_ids=[1, 2], timing=stamps)
    ht.on_output(out, detokenize_ns=500_000)
    ht.on_output(pb.engine.RequestOutput(request_id="r", new_token_ids=[3]), detokenize_ns=250_000)
    b = timer.breakdown(ht)
    assert (b["queue_ms"], b["prefill_ms"], b["decode_ms"]) == (1.0, 3.0, 6.0)
    assert (b["tokenize_ms"], b["detokenize_ms"]) == (2.0, 0.75)
    assert b["total_ms"] >= 0
    assert set(timer.to_proto(ht).DESCRIPTOR.fields_by_name) == set(b)


def test_return_timing_passes_the_unknown_field_check():
    assert parse_body(CompletionRequest, b'{"prompt": "x", "return_timing": true}').return_timing
    req = parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]}')
    assert req.return_timing is False
