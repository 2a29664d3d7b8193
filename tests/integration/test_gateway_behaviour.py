"""Gateway behaviour through the real mesh: request ids, limits, stop strings stopping the
engine, token-id prompts and gRPC Abort."""
from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.test_lifecycle import scheduler_load, wait_idle


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
        yield c


def test_request_id_is_echoed_when_sane_and_generated_otherwise(http, mesh):
    body = {"model": mesh.model_name, "prompt": "Hi", "max_tokens": 1}
    assert http.post("/v1/completions", json=body,
                     headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
    generated = http.post("/v1/completions", json=body,
                          headers={"X-Request-Id": "bad id\twith spaces"}).headers["x-request-id"]
    assert generated and generated != "bad id\twith spaces"
    assert http.post("/v1/completions", json={"prompt": 1}).headers["x-request-id"]


def test_oversized_body_is_a_413_in_openai_shape(http, mesh):
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_n_above_the_limit_is_rejected_with_a_clear_message(http, mesh):
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "Hi", "n": 17})
    assert r.status_code == 400 and "n must be in [1, 16]" in r.json()["error"]["message"]


def test_health_and_models_report_the_context_length(http, mesh):
    assert http.get("/health").status_code == 200
    card = http.get("/v1/models").json()["data"][0]   # [1] is the embedding model
    assert card["id"] == mesh.model_name and card["max_model_len"] == 2048


def test_token_id_prompts_match_text_prompts(http, mesh):
    text = {"model": mesh.model_name, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0}
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        ids = list(pb.generation_grpc.GenerationStub(ch).Tokenize(
            pb.generation.TokenizeRequest(text=text["prompt"]), timeout=30).token_ids)
    a = http.post("/v1/completions", json=text).json()
    b = http.post("/v1/completions", json={**text, "prompt": [ids]}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] == len(ids)


def test_a_stop_string_finishes_the_request_and_frees_the_engine(http, mesh):
    args = {"model": mesh.model_name, "prompt": "1, 2, 3, 4,", "temperature": 0,
            "ignore_eos": True}
    base = http.post("/v1/completions", json={**args, "max_tokens": 8}).json()["choices"][0]["text"]
    stop = base[2:5]
    assert stop.strip(), base
    start = time.monotonic()
    r = http.post("/v1/completions", json={**args, "max_tokens": 1500, "stop": stop}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop
    assert r["choices"][0]["text"] == base[:base.index(stop)]
    assert r["usage"]["completion_tokens"] < 20
    assert wait_idle(mesh) < 5.0 and time.monotonic() - start < 60


def test_grpc_abort_by_request_id_ends_the_stream_and_frees_the_engine(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        call = stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, request_id="abort-me", text="Once upon a time",
            sampling=pb.common.SamplingParams(max_tokens=1500, ignore_eos=True)), timeout=120)
        next(call)
        assert scheduler_load(mesh).num_running == 1
        assert stub.Abort(pb.generation.AbortRequest(request_ids=["abort-me", "unknown"]),
                          timeout=10).aborted == 1
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED
    assert wait_idle(mesh) < 5.0


def test_concurrent_requests_each_get_their_own_output(http, mesh):
    prompts = ["The sky is", "Water boils at", "My name is", "Cats like to"]
    expected = {p: http.post("/v1/completions", json={
        "model": mesh.model_name, "prompt": p, "max_tokens": 6, "temperature": 0}).json()
        ["choices"][0]["text"] for p in prompts}
    got: dict[str, str] = {}

    def run(p: str) -> None:
        with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
            got[p] = c.post("/v1/completions", json={
                "model": mesh.model_name, "prompt": p, "max_tokens": 6,
                "temperature": 0}).json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
