"""A real tool call end to end: SmolLM2 with the model's own chat template and a one-shot
example emits a Hermes-style <tool_call>, and the gateway (--tool-call-parser hermes) returns
it as OpenAI tool_calls with finish_reason "tool_calls", whole and streamed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from openai import OpenAI

from tests.integration.gateway_proc import start_gateway

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SHOT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "system", "content": "You call tools. To get weather, answer ONLY with a tool call like:\n" + SHOT},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": SHOT},
            {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_mesh(mesh):
    """A gateway with --tool-call-parser hermes in front of the shared mesh (the parser is the
    gateway's; no second model load)."""
    gw = start_gateway(mesh, "--tool-call-parser", "hermes")
    yield SimpleNamespace(http_url=f"http://127.0.0.1:{gw.http_port}", model_name=mesh.model_name)
    gw.stop()


@pytest.fixture(scope="module")
def client(tool_mesh):
    return OpenAI(base_url=f"{tool_mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_the_model_calls_a_tool_and_the_parser_returns_it(client, tool_mesh):
    r = client.chat.completions.create(model=tool_mesh.model_name, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id and not choice.message.content


def test_a_streamed_tool_call_assembles_to_the_same_call(client, tool_mesh):
    chunks = list(client.chat.completions.create(model=tool_mesh.model_name, messages=MESSAGES, tools=TOOLS,
                                                 max_tokens=40, temperature=0, stream=True))
    name, args, ids = "", "", set()
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    for tc in deltas:
        assert tc.index == 0
        if tc.id:
            ids.add(tc.id)
        if tc.function:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"} and len(ids) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_leaves_the_text_as_content(client, tool_mesh):
    r = client.chat.completions.create(model=tool_mesh.model_name, messages=MESSAGES, tools=TOOLS,
                                       tool_choice="none", max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason != "tool_calls" and not r.choices[0].message.tool_calls


def test_the_tool_result_turn_is_answered(client, tool_mesh):
    first = client.chat.completions.create(model=tool_mesh.model_name, messages=MESSAGES, tools=TOOLS,
                                           max_tokens=40, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=tool_mesh.model_name, messages=history, tools=TOOLS, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0


FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12}},
                                          "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                                          "required": ["a", "b"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
# No example and a question that needs no tool: left free, the model answers in prose.
CHAT = [{"role": "user", "content": "Tell me something nice about the sea."}]


def streamed_calls(chunks) -> dict[int, list[str]]:
    """index -> [name, arguments] assembled from a stream's tool-call deltas."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, ["", ""])
            if tc.function:
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
    return calls


def _assert_valid_calls(calls, allowed):
    import jsonschema
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice,allowed", [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_required_and_named_tool_choice_force_calls_that_validate(client, tool_mesh, tool_choice, allowed):
    # One call: left to allow several, greedy SmolLM2 goes on calling until max_tokens.
    r = client.chat.completions.create(model=tool_mesh.model_name, messages=CHAT, tools=FORCED_TOOLS,
                                       tool_choice=tool_choice, max_tokens=96, temperature=0,
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], allowed)
    free = client.chat.completions.create(model=tool_mesh.model_name, messages=CHAT, tools=FORCED_TOOLS,
                                          tool_choice="auto", max_tokens=24, temperature=0)
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls  # auto stays free


def test_a_forced_tool_call_streams_and_validates(client, tool_mesh):
    chunks = list(client.chat.completions.create(
        model=tool_mesh.model_name, messages=CHAT, tools=FORCED_TOOLS, tool_choice="required", max_tokens=96,
        temperature=0.8, seed=7, stream=True, parallel_tool_calls=False))
    calls = streamed_calls(chunks)
    assert len(calls) == 1                      # parallel_tool_calls false: one call
    _assert_valid_calls([tuple(v) for v in calls.values()], {"get_weather", "add"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_forced_tool_choice_with_another_constraint_is_a_400(client, tool_mesh):
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=tool_mesh.model_name, messages=CHAT, tools=FORCED_TOOLS,
                                       tool_choice="required", response_format={"type": "json_object"},
                                       max_tokens=8)
    assert "tool_choice" in str(err.value)


def _streamed_calls(chunks):
    """{index: [first delta, later deltas]} of a streamed response's tool calls."""
    calls: dict[int, list] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            calls.setdefault(tc.index, []).append(tc)
    return calls


@pytest.mark.parametrize("forced", [False, True])
def test_streamed_arguments_arrive_in_fragments_as_they_are_generated(client, tool_mesh, forced):
    # Free (the one-shot example) and forced by tool_choice's grammar: either way the first delta
    # names the call and the arguments follow in several fragments that assemble to the JSON.
    args = (dict(messages=CHAT, tools=FORCED_TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                 parallel_tool_calls=False, max_tokens=96) if forced else
            dict(messages=MESSAGES, tools=TOOLS, max_tokens=40))
    chunks = list(client.chat.completions.create(model=tool_mesh.model_name, temperature=0, stream=True, **args))
    [(index, deltas)] = _streamed_calls(chunks).items()
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == ("add" if forced else "get_weather")
    assert first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in rest)
    fragments = [d.function.arguments for d in rest if d.function.arguments]
    assert len(fragments) > 1, fragments
    arguments = json.loads("".join(fragments))
    if forced:
        _assert_valid_calls([("add", json.dumps(arguments))], {"add"})
    else:
        assert arguments == {"city": "Paris"}
