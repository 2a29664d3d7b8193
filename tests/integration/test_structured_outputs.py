"""Structured outputs through the running mesh: the gateway refuses a bad constraint the same way
over HTTP (400, naming the field) and gRPC (INVALID_ARGUMENT, the same message), before any
tokenizer or engine work."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from services.common import pb

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=60) as c:
        yield c


def grpc_refusal(mesh, sampling: "pb.common.SamplingParams") -> grpc.RpcError:
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(pb.generation.GenerateRequest(
                model=mesh.model_name, text="hi", sampling=sampling), timeout=30))
    return exc.value


def test_a_bad_schema_is_http_400_and_grpc_invalid_argument_with_the_same_message(http, mesh):
    r = http.post("/v1/chat/completions", json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("invalid json_schema constraint: ")

    err = grpc_refusal(mesh, pb.common.SamplingParams(
        max_tokens=4, structured=pb.common.StructuredOutput(json_schema=json.dumps(BAD_SCHEMA))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == error["message"]


def test_ignore_eos_with_a_constraint_is_refused_on_both_apis(http, mesh):
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "x", "max_tokens": 4,
                                           "ignore_eos": True, "guided_choice": ["a", "b"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "ignore_eos cannot be combined with structured outputs",
                                 "type": "invalid_request_error", "param": "ignore_eos", "code": None}
    err = grpc_refusal(mesh, pb.common.SamplingParams(
        max_tokens=4, ignore_eos=True,
        structured=pb.common.StructuredOutput(choice=pb.common.ChoiceList(choices=["a", "b"]))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "ignore_eos cannot be combined with structured outputs"


def test_two_constraints_are_a_400_on_completions_and_chat(http, mesh):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = http.post(path, json={"model": mesh.model_name, "max_tokens": 4, **body,
                                  "response_format": {"type": "json_object"},
                                  "structured_outputs": {"regex": "a+"}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format"
        assert "only one output constraint" in r.json()["error"]["message"]
