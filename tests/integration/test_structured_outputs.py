"""Structured outputs through the running mesh: the gateway refuses a bad constraint the same way
over HTTP (400, naming the field) and gRPC (INVALID_ARGUMENT, the same message), before any
tokenizer or engine work; hostile constraints are refused quickly while the mesh keeps serving;
constrained outputs (a battery of schemas, regex, choice, json_object) follow their constraint,
whole and streamed, with n=2."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration import structured_battery as battery

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


# ---- the output follows the constraint (the worker enforces it while sampling) -----------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]


def chat_outputs(http, mesh, n=1, max_tokens=96, **fields) -> list[tuple[str, str]]:
    r = http.post("/v1/chat/completions", json={"model": mesh.model_name, "messages": ASK,
                                                "temperature": 0, "max_tokens": max_tokens,
                                                "n": n, **fields})
    assert r.status_code == 200, r.text
    return [(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]]


def test_a_json_schema_output_parses_and_validates(http, mesh):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for text, reason in chat_outputs(http, mesh, n=2, response_format=fmt):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_and_json_object_outputs_follow_their_constraint(http, mesh):
    import concurrent.futures as cf
    import re
    with cf.ThreadPoolExecutor(3) as pool:   # the three constraints at once (the engine batches them)
        regex = pool.submit(chat_outputs, http, mesh, structured_outputs={"regex": r"[0-9]{3}-[0-9]{4}"})
        choice = pool.submit(chat_outputs, http, mesh, guided_choice=["cat", "dog", "fish"])
        obj = pool.submit(chat_outputs, http, mesh, max_tokens=64, response_format={"type": "json_object"})
        [(text, _)] = regex.result()
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
        [(text, _)] = choice.result()
        assert text in ("cat", "dog", "fish")
        [(text, reason)] = obj.result()
    if reason == "stop":   # a length stop may leave the object unfinished
        assert isinstance(json.loads(text), dict), text
    else:
        assert text.lstrip().startswith("{"), text


def test_a_streamed_json_schema_output_validates(http, mesh):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    text = ""
    with http.stream("POST", "/v1/chat/completions", json={
            "model": mesh.model_name, "messages": ASK, "temperature": 0, "max_tokens": 96,
            "stream": True, "response_format": fmt}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    jsonschema.validate(json.loads(text), PERSON)


# ---- a battery of schemas: whole and streamed, n=2 ----------------------------------------------
@pytest.fixture(scope="module")
def client(mesh):
    from openai import OpenAI
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def battery_runs(client, mesh):
    """Every schema whole and streamed, all asked at once (the engine batches the 24 sequences;
    a few at a time cost nearly as much each): {name: (whole, streamed) futures}."""
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(2 * len(battery.SCHEMAS)) as pool:
        yield {name: (pool.submit(battery.run_whole, client, mesh.model_name, name),
                      pool.submit(battery.run_streamed, client, mesh.model_name, name)) for name in battery.SCHEMAS}


@pytest.mark.parametrize("name", sorted(battery.SCHEMAS))
def test_every_schema_of_the_battery_validates_whole_and_streamed_with_n2(battery_runs, name):
    whole, streamed = battery_runs[name]
    assert whole.result(timeout=240) == 2
    assert streamed.result(timeout=240) == 2


# ---- hostile constraints: a 400 within a bound, and the mesh keeps serving ----------------------
HOSTILE = {
    "huge": {"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
    "deep": {"guided_json": json.loads('{"type": "object", "properties": {"a": ' * 40 + '{"type": "string"}'
                                       + "}}" * 40)},
    "ref_cycle": {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                  "$ref": "#/$defs/a"}},
    "bad_regex": {"guided_regex": "(a" * 2000},
    "unsatisfiable": {"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}},
}


def test_hostile_constraints_are_refused_quickly_while_the_mesh_keeps_serving(http, mesh):
    import concurrent.futures as cf
    import time

    def free_text() -> str:
        r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "The sea is",
                                               "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    want = free_text()
    with cf.ThreadPoolExecutor(4) as pool:
        background = [pool.submit(free_text) for _ in range(4)]
        for name, fields in HOSTILE.items():
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json={"model": mesh.model_name, "messages": ASK,
                                                        "max_tokens": 8, **fields})
            took = time.monotonic() - t0
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["message"], name
            assert took < 5.0, f"{name}: refused after {took:.1f} s"
        assert [f.result(timeout=120) for f in background] == [want] * 4
