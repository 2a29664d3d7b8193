"""Bad input gets a clear 4xx in the OpenAI error shape (or INVALID_ARGUMENT over gRPC), and the
mesh keeps serving the next request."""
from __future__ import annotations

import grpc
import httpx
import pytest

from services.common import pb


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]


def assert_still_serving(http, mesh) -> None:
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_malformed_json_is_a_400(http, mesh):
    r = http.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert_still_serving(http, mesh)


def test_unknown_model_is_a_404(http, mesh):
    r = http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(r, 404, "gpt-17")
    assert_still_serving(http, mesh)


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_non_positive_max_tokens_is_a_400(http, mesh, max_tokens):
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "Hi", "max_tokens": max_tokens})
    assert_openai_error(r, 400, "max_tokens")
    assert_still_serving(http, mesh)


def test_prompt_longer_than_the_context_is_a_400(http, mesh):
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "word " * 3000, "max_tokens": 4})
    assert_openai_error(r, 400)
    assert "2048" in r.json()["error"]["message"]
    assert_still_serving(http, mesh)


@pytest.mark.parametrize("body", [
    {"prompt": "Hi", "max_tokens": "ten"},
    {"prompt": "Hi", "temperature": "hot"},
    {"prompt": 12},
])
def test_wrong_types_are_a_400(http, mesh, body):
    r = http.post("/v1/completions", json={"model": mesh.model_name, **body})
    assert_openai_error(r, 400)
    assert_still_serving(http, mesh)


def test_chat_messages_of_the_wrong_shape_are_a_400(http, mesh):
    r = http.post("/v1/chat/completions", json={"model": mesh.model_name, "messages": "hello"})
    assert_openai_error(r, 400)
    assert_still_serving(http, mesh)


def test_grpc_bad_input_is_invalid_argument_and_unknown_model_not_found(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        cases = [
            (pb.generation.GenerateRequest(model=mesh.model_name, text="hi",
                                           sampling=pb.common.SamplingParams(max_tokens=-1)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.generation.GenerateRequest(model=mesh.model_name, text="word " * 3000,
                                           sampling=pb.common.SamplingParams(max_tokens=4)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.generation.GenerateRequest(model=mesh.model_name, sampling=pb.common.SamplingParams(max_tokens=4)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.generation.GenerateRequest(model="nope", text="hi"), grpc.StatusCode.NOT_FOUND),
        ]
        for req, code in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, timeout=60))
            assert info.value.code() == code, info.value.details()
            assert info.value.details()
        ok = list(stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text="Hello", sampling=pb.common.SamplingParams(max_tokens=3)), timeout=60))
        assert sum(len(r.token_ids) for r in ok) >= 1


def test_error_bodies_quote_a_bounded_prefix_of_a_huge_input(http, mesh):
    huge = "m" * (3 * 1024 * 1024)                      # a 3 MB model name, under the body limit
    r = http.post("/v1/chat/completions", json={"model": huge, "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(r, 404, "does not exist", "truncated")
    assert len(r.content) < 4096
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "hi", "x" * 100_000: 1})
    assert_openai_error(r, 400, "unknown field")
    assert len(r.content) < 4096 and len(r.json()["error"]["param"]) <= 128
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(pb.generation_grpc.GenerationStub(ch).Generate(
                pb.generation.GenerateRequest(model=huge, text="hi"), timeout=60))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(info.value.details()) <= 1024
    assert_still_serving(http, mesh)
