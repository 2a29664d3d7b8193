"""Prometheus metrics and the timing breakdown, against the real mesh (session fixture).

A known workload goes in; the scraped counters must move by exactly what the responses
report (requests, prompt tokens, generated tokens) and the latency histograms by one
observation per request. Deltas are used because the mesh is shared with other tests."""
from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import grpc
import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from services.common import pb
from tests.integration.meshproc import ROOT

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
ENGINE_SERVICES = ("scheduler", "worker", "tokenizer")


def scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode(), r.headers["Content-Type"]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition (parsed strictly)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in parse_prometheus(text) for s in fam.samples}


def total(snap: dict, name: str, /, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in snap.items() if n == name and want <= set(ls))


@pytest.fixture(scope="module")
def endpoints(mesh) -> dict[str, str]:
    svc = mesh.services()
    urls = {"gateway": f"{mesh.http_url}/metrics"}
    for name in ENGINE_SERVICES:
        assert f"{name}-metrics" in svc, f"the launcher printed no {name}-metrics address: {svc}"
        urls[name] = f"http://{svc[name + '-metrics']}/metrics"
    return urls


def snapshot(endpoints) -> dict[str, dict]:
    return {name: samples(scrape(url)[0]) for name, url in endpoints.items()}


def settled(endpoints, before: dict, expected: dict, timeout_s: float = 10.0) -> dict:
    """Scrape until the `expected` {(service, name, labels): delta} are reached: a service
    counts a call when its handler returns, which may be just after the client got its answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = snapshot(endpoints)
        if all(total(after[svc], name, **dict(ls)) - total(before[svc], name, **dict(ls)) >= want
               for (svc, name, ls), want in expected.items()) or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def test_counters_and_histograms_match_a_known_workload(mesh, endpoints):
    before = snapshot(endpoints)
    usages, finishes = [], []
    with httpx.Client(base_url=mesh.http_url, timeout=120) as http:
        for i, max_tokens in enumerate((3, 5, 8)):
            r = http.post("/v1/completions", json={"model": mesh.model_name, "max_tokens": max_tokens,
                                                   "prompt": f"Request {i}: tell me about the sea"})
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
            finishes.append(r.json()["choices"][0]["finish_reason"])
        r = http.post("/v1/chat/completions", json={"model": mesh.model_name, "max_tokens": 6,
                                                    "messages": [{"role": "user", "content": "Hi!"}]})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
        finishes.append(r.json()["choices"][0]["finish_reason"])
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        out = list(pb.generation_grpc.GenerationStub(ch).Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text="Count to three", sampling=pb.common.SamplingParams(max_tokens=4)),
            timeout=120))
    usages.append({"prompt_tokens": out[-1].usage.prompt_tokens,
                   "completion_tokens": out[-1].usage.completion_tokens})
    finishes.append({pb.common.FINISH_REASON_STOP: "stop",
                     pb.common.FINISH_REASON_LENGTH: "length"}[out[-1].finish_reason])
    after = settled(endpoints, before, {
        ("gateway", "meshllm:http_requests_total", (("route", "/v1/chat/completions"),)): 1,
        ("gateway", "meshllm:grpc_server_requests_total", (("method", "Generate"),)): 1,
        ("tokenizer", "meshllm:grpc_server_requests_total", (("method", "Encode"),)): 4})

    def delta(where: str, name: str, /, **labels) -> float:
        return total(after[where], name, **labels) - total(before[where], name, **labels)

    n = len(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    labels = {"model_name": mesh.model_name, "engine": "0"}
    assert delta("scheduler", "meshllm:engine_requests_submitted_total", **labels) == n
    assert delta("scheduler", "meshllm:prompt_tokens_total", **labels) == prompt
    assert delta("scheduler", "meshllm:generation_tokens_total", **labels) == generated
    for reason in ("stop", "length"):
        assert delta("scheduler", "meshllm:request_success_total", finished_reason=reason,
                     **labels) == finishes.count(reason)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens"):
        assert delta("scheduler", f"meshllm:{hist}_count", **labels) == n, hist
    assert delta("scheduler", "meshllm:request_prompt_tokens_sum", **labels) == prompt
    assert delta("scheduler", "meshllm:request_generation_tokens_sum", **labels) == generated
    assert delta("scheduler", "meshllm:inter_token_latency_seconds_count", **labels) == sum(
        u["completion_tokens"] >= 2 for u in usages)
    # Every histogram's +Inf bucket is its count, and buckets never decrease.
    checked = 0
    for (name, ls), value in after["scheduler"].items():
        inf = (name[:-6] + "_bucket", tuple(sorted((dict(ls) | {"le": "+Inf"}).items())))
        if name.endswith("_count") and inf in after["scheduler"]:
            assert after["scheduler"][inf] == value, name
            checked += 1
    assert checked >= 10
    steps = delta("scheduler", "meshllm:step_batch_size_count", **labels)
    assert steps >= max(u["completion_tokens"] for u in usages)
    assert delta("scheduler", "meshllm:step_duration_seconds_count", **labels) == steps
    # Async scheduling may sample one token past a stop (dropped): the worker sees >= generated.
    assert delta("worker", "meshllm:worker_sampled_tokens_total", **labels) >= generated
    assert delta("worker", "meshllm:worker_steps_total", **labels) >= steps
    # Engine state is present (values depend on timing; the ranges do not).
    assert 0 <= total(after["scheduler"], "meshllm:kv_cache_usage_perc", **labels) <= 1
    assert total(after["scheduler"], "meshllm:prefix_cache_queries_total", **labels) >= prompt
    # Per-service request counters by status.
    assert delta("gateway", "meshllm:http_requests_total", route="/v1/completions", status="200") == 3
    assert delta("gateway", "meshllm:http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert delta("gateway", "meshllm:http_request_duration_seconds_count", route="/v1/completions") == 3
    assert delta("gateway", "meshllm:grpc_server_requests_total", service="gateway", method="Generate",
                 code="OK") == 1
    assert delta("tokenizer", "meshllm:grpc_server_requests_total", method="Encode", code="OK") == 4
    assert delta("tokenizer", "meshllm:grpc_server_requests_total", method="ApplyChatTemplate",
                 code="OK") == 1


def test_errors_are_counted_by_status(mesh, endpoints):
    before = snapshot(endpoints)
    r = httpx.post(f"{mesh.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400
    r = httpx.get(f"{mesh.http_url}/no/such/path/{os.getpid()}", timeout=30)
    assert r.status_code == 404
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(pb.generation_grpc.GenerationStub(ch).Generate(pb.generation.GenerateRequest(
                model="no-such-model", text="x"), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    expected = {("gateway", "meshllm:http_requests_total", (("route", "/v1/completions"), ("status", "400"))): 1,
                ("gateway", "meshllm:http_requests_total", (("route", "unmatched"), ("status", "404"))): 1,
                ("gateway", "meshllm:grpc_server_requests_total", (("method", "Generate"),
                                                                    ("code", "NOT_FOUND"))): 1}
    after = settled(endpoints, before, expected)
    for (svc, name, ls), want in expected.items():
        assert total(after[svc], name, **dict(ls)) - total(before[svc], name, **dict(ls)) == want, ls


def test_openmetrics_exposition_keeps_names_and_parses(mesh, endpoints):
    for name, url in endpoints.items():
        text, content_type = scrape(url, OPENMETRICS)
        assert content_type.startswith("application/openmetrics-text"), (name, content_type)
        assert text.endswith("# EOF\n")
        names = {f.name for f in parse_openmetrics(text)}
        assert any(n.startswith("meshllm:") for n in names), name
        assert not any(n.startswith("meshllm_") for n in names), name  # colons kept
        text, content_type = scrape(url)
        assert content_type.startswith("text/plain; version=0.0.4")
        assert list(parse_prometheus(text))


def test_dashboard_references_only_metrics_that_exist(endpoints):
    exposed = set()
    for url in endpoints.values():
        for fam in parse_prometheus(scrape(url)[0]):
            exposed.update(s.name for s in fam.samples)
    with open(os.path.join(ROOT, "deploy/grafana/dashboards/meshllm.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"meshllm:[A-Za-z0-9_:]+", e)}
    assert len(used) >= 15
    assert not used - exposed, f"the dashboard uses metrics no service exposes: {sorted(used - exposed)}"
    panels_by_engine = [p for p in dashboard["panels"] if "engine" in json.dumps(p["targets"])]
    assert len(panels_by_engine) >= 10


def _check_timing(timing: dict) -> None:
    parts = ("queue_ms", "prefill_ms", "decode_ms", "tokenize_ms", "detokenize_ms")
    assert set(timing) == {*parts, "total_ms", "kv_transfer_ms"}
    assert all(timing[k] >= 0 for k in timing), timing
    assert timing["kv_transfer_ms"] == 0.0   # a colocated engine hands nothing over (docs/pd.md)
    assert timing["prefill_ms"] > 0 and timing["decode_ms"] > 0 and timing["tokenize_ms"] > 0
    # The scheduler's interval lies inside the gateway's (after tokenizing, before the last
    # token is ready); detokenize overlaps decode, so it is bounded by the total alone.
    engine = timing["queue_ms"] + timing["prefill_ms"] + timing["decode_ms"]
    assert timing["tokenize_ms"] + engine <= timing["total_ms"] + 1.0, timing
    assert timing["detokenize_ms"] <= timing["total_ms"], timing


def test_timing_breakdown_over_http_and_grpc(mesh):
    body = {"model": mesh.model_name, "max_tokens": 4, "return_timing": True,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    with httpx.Client(base_url=mesh.http_url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        _check_timing(r.json()["timing"])
        plain = http.post("/v1/chat/completions", json={**body, "return_timing": False}).json()
        assert "timing" not in plain
        with http.stream("POST", "/v1/completions", json={"model": mesh.model_name, "prompt": "Once upon",
                                                          "max_tokens": 4, "stream": True,
                                                          "return_timing": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c for c in chunks if "timing" in c] == [chunks[-1]]  # only the final chunk has it
        _check_timing(chunks[-1]["timing"])
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        out = list(pb.generation_grpc.GenerationStub(ch).Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text="Once upon", sampling=pb.common.SamplingParams(max_tokens=3),
            return_timing=True), timeout=120))
    assert out[-1].HasField("timing") and not any(r.HasField("timing") for r in out[:-1])
    t = out[-1].timing
    _check_timing({f: getattr(t, f) for f in ("queue_ms", "prefill_ms", "decode_ms", "tokenize_ms",
                                              "detokenize_ms", "total_ms", "kv_transfer_ms")})


def test_latency_exemplars_carry_the_requests_trace_id(smollm2_dir):
    """With tracing on, the scheduler's and the gateway's latency histograms point at the
    request's trace (the one the OTLP receiver got), in the OpenMetrics exposition only."""
    from tests.integration.meshproc import start_mesh
    from tests.integration.otlp_receiver import OtlpReceiver
    with OtlpReceiver() as rx:
        traced = start_mesh(str(smollm2_dir), "--simulate-worker", "--simulate-step-ms", "1",
                            "--otlp-traces-endpoint", rx.endpoint)
        try:
            r = httpx.post(f"{traced.http_url}/v1/completions", timeout=60,
                           json={"model": traced.model_name, "prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200, r.text
            spans = rx.wait_for(lambda s: any(x.name == "POST /v1/completions" for x in s))
            trace_id = next(x.trace_id for x in spans if x.name == "POST /v1/completions")
            scheduler = f"http://{traced.services()['scheduler-metrics']}/metrics"
            found = {}
            deadline = time.monotonic() + 10
            while len(found) < 3 and time.monotonic() < deadline:
                for url in (scheduler, f"{traced.http_url}/metrics"):
                    for fam in parse_openmetrics(scrape(url, OPENMETRICS)[0]):
                        for s in fam.samples:
                            if s.exemplar is not None and s.exemplar.labels.get("trace_id") == trace_id:
                                found[fam.name] = s.exemplar.value
                time.sleep(0.1)
            assert {"meshllm:time_to_first_token_seconds", "meshllm:e2e_request_latency_seconds",
                    "meshllm:http_request_duration_seconds"} <= set(found), found
            assert " # {trace_id=" not in scrape(scheduler)[0]   # not in the classic format
        finally:
            traced.stop()
