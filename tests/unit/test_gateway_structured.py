"""Structured outputs on the gateway: every OpenAI / vLLM shape parsed into the wire's
StructuredOutput, and every refusal (shape, conflicts, bounds, grammar engine, ignore_eos) with
its message and the field it names."""
from __future__ import annotations

import asyncio
import json
import types

import pytest

from services.common import pb
from services.common.sampling_rules import RequestOptions
from services.common.structured import MAX_CONSTRAINT_BYTES, MAX_SCHEMA_DEPTH, NO_OUTPUT
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.service import STRUCTURED_INLINE_BYTES, Gateway

MESSAGES = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({"messages": MESSAGES, **fields}).encode())


def completion(**fields) -> CompletionRequest:
    return parse_body(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())


def refusal(call) -> dict:
    with pytest.raises(ApiError) as exc:
        call()
    assert exc.value.kind == "invalid_argument"
    return exc.value.to_openai()["error"]


@pytest.fixture(scope="module")
def gateway() -> Gateway:
    # Gateway.limits() reads only the engine's EngineInfo; no engine is needed to check sampling.
    engine = types.SimpleNamespace(info=pb.engine.EngineInfo(max_model_len=2048, vocab_size=49152))
    return Gateway(GatewayConfig(), tokenizer=None, engine=engine)


def checked(gw: Gateway, req) -> "pb.common.SamplingParams":
    """The HTTP path: to_sampling, then the rulebook (check_sampling), as completions.py runs it."""
    sp = req.to_sampling()
    asyncio.run(gw.check_sampling(sp, req.rule_options(), req.structured_param))
    return sp


# ---- parsing: every shape into the right StructuredOutput ---------------------------------------
@pytest.mark.parametrize("make", [chat, completion])
def test_response_format_json_schema_becomes_the_schema_as_json_text(make, gateway):
    req = make(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True, "description": "a person"}})
    sp = checked(gateway, req)
    assert sp.structured.WhichOneof("kind") == "json_schema"
    assert json.loads(sp.structured.json_schema) == SCHEMA
    assert req.structured_param == "response_format"


@pytest.mark.parametrize("make", [chat, completion])
def test_response_format_json_object_becomes_json_object(make, gateway):
    sp = checked(gateway, make(response_format={"type": "json_object"}))
    assert sp.structured.WhichOneof("kind") == "json_object" and sp.structured.json_object


def test_response_format_text_and_no_constraint_leave_the_output_free(gateway):
    assert not checked(gateway, chat(response_format={"type": "text"})).HasField("structured")
    assert not checked(gateway, chat()).HasField("structured")


@pytest.mark.parametrize("fields, kind, value", [
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, "regex", r"\d{3}-\d{4}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar", 'start: "a" | "b"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
    ({"guided_choice": ["red", "green"]}, "choice", ["red", "green"]),
    ({"guided_grammar": 'root ::= "x" | "y"'}, "grammar", 'root ::= "x" | "y"'),   # GBNF
])
@pytest.mark.parametrize("make", [chat, completion])
def test_vllm_structured_outputs_and_guided_extras_become_their_constraint(make, fields, kind, value,
                                                                          gateway):
    so = checked(gateway, make(**fields)).structured
    assert so.WhichOneof("kind") == kind
    got = {"json_schema": lambda: json.loads(so.json_schema), "choice": lambda: list(so.choice.choices)}
    assert got.get(kind, lambda: getattr(so, kind))() == value


# ---- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, says", [
    ({"type": "json_schema"}, "needs a json_schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}},
     "only allowed with type json_schema"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format"),
    ({}, "response_format.type"),
])
def test_a_malformed_response_format_is_a_400_naming_response_format(fmt, says):
    err = refusal(lambda: chat(response_format=fmt).to_sampling())
    assert says in err["message"] and err["param"] == "response_format"


@pytest.mark.parametrize("so, got", [({}, 0), ({"regex": "a", "choice": ["a"]}, 2),
                                     ({"json": SCHEMA, "json_object": True}, 2)])
def test_structured_outputs_must_name_exactly_one_constraint(so, got):
    err = refusal(lambda: chat(structured_outputs=so).to_sampling())
    assert err["message"] == ("structured_outputs needs exactly one of json, regex, choice, grammar "
                              f"or json_object, got {got}")
    assert err["param"] == "structured_outputs"


def test_a_vllm_backend_knob_in_structured_outputs_is_refused_as_unknown():
    err = refusal(lambda: chat(structured_outputs={"regex": "a", "whitespace_pattern": " "}))
    assert "unknown field 'structured_outputs.whitespace_pattern'" in err["message"]
    assert err["param"] == "structured_outputs"


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
      "guided_json": SCHEMA}, "response_format"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
])
def test_two_constraints_in_one_request_are_refused(fields, param):
    err = refusal(lambda: completion(**fields).to_sampling())
    assert err["message"].startswith("only one output constraint is allowed per request, got ")
    assert err["param"] == param


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields, param, says", [
    ({"guided_choice": []}, "guided_choice", "choice needs 1 to 256 strings, got 0"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs",
     "choice strings must not be empty"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid regex constraint: "),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", "the regex constraint is empty"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs",
     "the JSON schema is not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format", "invalid json_schema constraint: "),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid grammar constraint: "),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs",
     "json_object must be true when it is the constraint"),
])
def test_a_bad_constraint_is_a_400_from_the_rulebook_naming_its_field(fields, param, says, gateway):
    err = refusal(lambda: checked(gateway, chat(**fields)))
    assert says in err["message"] and err["param"] == param


def test_a_schema_nesting_deeper_than_the_limit_is_refused(gateway):
    # Nesting of the schema document: each level of _deep_schema is two brackets deep.
    ok = chat(guided_json=_deep_schema(MAX_SCHEMA_DEPTH // 2 - 1))
    assert checked(gateway, ok).HasField("structured")
    deep = chat(guided_json=_deep_schema(MAX_SCHEMA_DEPTH // 2 + 1))
    err = refusal(lambda: checked(gateway, deep))
    assert err["message"] == f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
    assert err["param"] == "guided_json"


def test_a_constraint_over_64_kib_is_refused(gateway):
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    size = len(json.dumps(big).encode())
    assert size > MAX_CONSTRAINT_BYTES
    err = refusal(lambda: checked(gateway, completion(structured_outputs={"json": big})))
    assert err["message"] == (f"the json_schema constraint is {size} bytes; at most "
                              f"{MAX_CONSTRAINT_BYTES} are allowed")
    assert err["param"] == "structured_outputs"


def test_a_large_valid_schema_is_validated_off_the_event_loop_and_accepted(gateway):
    props = {f"field_{i}": {"type": "object", "properties": {
        f"sub_{j}": {"type": "integer"} for j in range(8)}} for i in range(60)}
    req = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "big", "schema": {"type": "object", "properties": props}}})
    assert len(req.to_sampling().structured.json_schema) > STRUCTURED_INLINE_BYTES
    assert checked(gateway, req).structured.WhichOneof("kind") == "json_schema"


@pytest.mark.parametrize("fields", [{"response_format": {"type": "json_object"}},
                                    {"guided_choice": ["a", "b"]}])
def test_ignore_eos_with_a_structured_output_is_refused(fields, gateway):
    err = refusal(lambda: checked(gateway, completion(ignore_eos=True, **fields)))
    assert err["message"] == "ignore_eos cannot be combined with structured outputs"
    assert err["param"] == "ignore_eos"
    assert not checked(gateway, completion(ignore_eos=True)).HasField("structured")


def test_the_grpc_path_gets_the_same_message_for_the_same_bad_schema(gateway):
    """gRPC passes SamplingParams as sent: the same rulebook, the same message."""
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    http = refusal(lambda: checked(gateway, chat(guided_json=bad)))
    sp = pb.common.SamplingParams(structured=pb.common.StructuredOutput(json_schema=json.dumps(bad)))
    grpc = refusal(lambda: asyncio.run(gateway.check_sampling(sp, RequestOptions())))
    assert grpc["message"] == http["message"]
    assert grpc["param"] == "structured_outputs"


def test_the_openapi_document_describes_response_format_and_structured_outputs(gateway):
    from fastapi import FastAPI

    from services.gateway.http import openapi
    from services.gateway.http.completions import add_completion_routes
    app = FastAPI()
    add_completion_routes(app, gateway)
    schemas = openapi.build(app)["components"]["schemas"]
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[model]["properties"]
        assert props["response_format"]["anyOf"][0] == {"$ref": "#/components/schemas/ResponseFormat"}
        assert props["guided_choice"]["anyOf"][0]["maxItems"] == 256
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert schemas["JsonSchemaFormat"]["required"] == ["name", "schema"]
    so = schemas["StructuredOutputsIn"]
    assert so["maxProperties"] == 1 and set(so["properties"]) == {"json", "regex", "choice", "grammar",
                                                                   "json_object"}
    assert so["properties"]["choice"]["anyOf"][0]["minItems"] == 1


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},                                                             # itself, forever
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_a_ref_cycle_that_never_reaches_a_value_is_refused(schema, gateway):
    """The engine's validation passes these; the probe (a first mask over bytes) does not: left to
    the worker, every such request would end at once with an empty output."""
    err = refusal(lambda: checked(gateway, chat(guided_json=schema)))
    assert err["message"] == "invalid json_schema constraint: " + NO_OUTPUT and err["param"] == "guided_json"


def test_recursive_schemas_and_backtracking_regexes_are_served_within_a_bound(gateway):
    """A real recursive schema (a tree) is fine, and so are regexes that are catastrophic for a
    backtracking matcher: llguidance's lexer is derivative-based (no backtracking) and its fuel
    bounds every step (parser_limits), so they are checked in milliseconds."""
    import time
    tree = {"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}}}}, "$ref": "#/$defs/n"}
    for req in (chat(guided_json=tree), chat(guided_regex="(a+)+$"), chat(guided_regex="((a|aa)*)*b"),
                chat(guided_regex="[ab]*a[ab]{20}")):
        t0 = time.perf_counter()
        assert checked(gateway, req).HasField("structured")
        assert time.perf_counter() - t0 < 2.0
