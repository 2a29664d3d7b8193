"""Generated requests against the real gateway: never a 5xx, never a hang, never a crash.

HTTP: hypothesis builds request bodies from the fields the API knows (right and wrong types,
edge values, unknown fields) plus raw byte garbage. gRPC: generated GenerateRequest /
TokenizeRequest messages (and undecodable bytes). Every generation is kept short
(max_tokens is always given and small or invalid), so a bounded number of examples runs in
a few seconds. (schemathesis needs an OpenAPI document with body schemas, which the gateway
does not publish: its routes read raw bodies to bound them first.)"""
from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common import pb

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
_json = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), c, max_size=4)),
                     max_leaves=12)
# null / absent max_tokens means "up to the context length" (minutes on a slow CPU), so every
# generated body names one; null is covered by the unit tests of the request parser.
_max_tokens = st.sampled_from([-1, 0, 1, 2, 2 ** 31, 10 ** 20, "2", 1.5, True])
_messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                             "tool", "robot"]),
                                    "content": st.one_of(st.text(max_size=40), _json)}),
             max_size=3),
    _json)
_fields = {
    "temperature": st.one_of(st.floats(-1, 3), _scalars), "top_p": st.one_of(st.floats(-1, 2), _scalars),
    "top_k": st.one_of(st.integers(-3, 100), _scalars), "min_p": st.floats(-1, 2),
    "n": st.one_of(st.integers(-2, 20), _scalars), "logprobs": st.one_of(st.integers(-2, 25), _scalars),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=40), _scalars),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 10 ** 6), max_size=5), _scalars),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=4),
                            _scalars),
    "min_tokens": st.one_of(st.integers(-2, 10), _scalars), "seed": st.one_of(st.integers(), _scalars),
    "stream": st.booleans(), "echo": _scalars, "ignore_eos": _scalars,
    "cache_salt": st.one_of(st.text(max_size=10), _scalars), "priority": st.one_of(st.integers(), _scalars),
    "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "unknown_" + "field": _json,
}


@st.composite
def _body(draw, chat: bool):
    body = {"max_tokens": draw(_max_tokens)}
    if draw(st.booleans()):
        body["model"] = draw(st.sampled_from(["smollm2-135m-instruct", "", "other", None]))
    if chat:
        body["messages"] = draw(_messages)
        for k in ("top_logprobs", "tools", "tool_choice", "chat_template_kwargs",
                  "response_format", "continue_final_message"):
            if draw(st.booleans()):
                body[k] = draw(_json)
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 60000),
                                                                       max_size=8), _json))
    for k in draw(st.sets(st.sampled_from(sorted(_fields)), max_size=5)):
        body[k] = draw(_fields[k])
    return body


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=60) as c:
        yield c


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@SETTINGS
@given(chat=st.booleans(), data=st.data())
def test_generated_http_bodies_never_get_a_5xx(http, chat, data):
    body = data.draw(_body(chat))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _check(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))


@SETTINGS
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                             "/detokenize", "/v1/embeddings"]),
       raw=st.binary(max_size=200),
       encoding=st.sampled_from([None, "gzip", "deflate", "zstd", "br", "identity"]))
def test_garbage_bytes_never_get_a_5xx(http, path, raw, encoding):
    headers = {"content-type": "application/json"}
    if encoding:
        headers["content-encoding"] = encoding
    _check(http.post(path, content=raw, headers=headers))


_ok_codes = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def _generate_request(draw):
    sp = pb.common.SamplingParams(
        temperature=draw(_floats), top_p=draw(_floats), top_k=draw(st.integers(-2 ** 31, 2 ** 31 - 1)),
        min_p=draw(_floats), presence_penalty=draw(_floats), repetition_penalty=draw(_floats),
        max_tokens=draw(st.sampled_from([-5, 1, 2, 2 ** 31 - 1])),
        min_tokens=draw(st.integers(-3, 5)),
        stop=draw(st.lists(st.text(max_size=4), max_size=40)),
        stop_token_ids=draw(st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=3)),
        logit_bias=draw(st.dictionaries(st.integers(-2 ** 31, 2 ** 31 - 1), _floats, max_size=3)))
    if draw(st.booleans()):
        sp.logprobs = draw(st.integers(-3, 30))
    req = pb.generation.GenerateRequest(
        model=draw(st.sampled_from(["", "smollm2-135m-instruct", "x"])), sampling=sp,
        n=draw(st.integers(-3, 20)), cache_salt=draw(st.text(max_size=10)),
        priority=draw(st.integers(-2 ** 31, 2 ** 31 - 1)),
        request_id=draw(st.sampled_from(["", "ok-id", "bad id\n", "x" * 200])))
    which = draw(st.sampled_from(["text", "token_ids", "chat", None]))
    if which == "text":
        req.text = draw(st.text(max_size=30))
    elif which == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(-5, 2 ** 31 - 1), max_size=5)))
    elif which == "chat":
        req.chat.messages.extend(pb.common.ChatMessage(role=r, content=c) for r, c in draw(
            st.lists(st.tuples(st.sampled_from(["user", "system", "bogus", ""]),
                               st.text(max_size=20)), max_size=3)))
        req.chat.tools_json = draw(st.sampled_from(["", "[]", "{", "[{\"type\": 1}]"]))
        req.chat.chat_template_kwargs_json = draw(st.sampled_from(["", "{}", "[", "{\"messages\": 1}"]))
    return req


@pytest.fixture(scope="module")
def grpc_stub(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        yield pb.generation_grpc.GenerationStub(ch), ch


@SETTINGS
@given(req=_generate_request())
def test_generated_grpc_requests_never_crash(grpc_stub, req):
    stub, _ = grpc_stub
    try:
        list(stub.Generate(req, timeout=60))
    except grpc.RpcError as err:
        assert err.code() in _ok_codes, (err.code(), err.details())


@SETTINGS
@given(raw=st.binary(max_size=100))
def test_undecodable_grpc_messages_never_crash(grpc_stub, raw):
    _, ch = grpc_stub
    call = ch.unary_stream("/meshllm.v1.Generation/Generate",
                           request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        list(call(raw, timeout=60))
    except grpc.RpcError as err:
        assert err.code() != grpc.StatusCode.UNAVAILABLE, err.details()


def test_the_gateway_still_serves_after_fuzzing(http, mesh):
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200
    assert http.get("/health").status_code == 200
