"""Anthropic's Messages API on the gateway, driven by the official `anthropic` client against the
real SmolLM2 mesh: create (system, turns, stop sequences, max_tokens, sampling), streaming events,
count_tokens, errors in Anthropic's shape; tools and x-api-key on a second, keyed gateway
(--tool-call-parser hermes) in front of the same mesh."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.integration.gateway_proc import start_gateway
from tests.integration.test_lifecycle import scheduler_load, wait_idle

KEY = "anthropic-key-0123"
SYSTEM = "You are a terse assistant."
TURNS = [{"role": "user", "content": "Name a fruit."},
         {"role": "assistant", "content": "Apple."},
         {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
COUNT = [{"role": "user", "content": "Count from 1 to 50, separated by spaces."}]
WEATHER = {"name": "get_weather", "description": "Get the weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
# A worked example (as in test_tool_calls_e2e.py): SmolLM2 then fills the forced call's
# arguments in a few tokens instead of wandering inside the JSON.
SHOT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_SYSTEM = "You call tools. Answer ONLY with a tool call like:\n" + SHOT
T0 = {"temperature": 0}   # greedy
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(mesh):
    return anthropic.Anthropic(base_url=mesh.http_url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def keyed(mesh):
    gw = start_gateway(mesh, "--api-key", KEY, "--tool-call-parser", "hermes")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def keyed_client(keyed):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{keyed.http_port}", api_key=KEY,
                               timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reasoning_client(mesh):
    # deepseek_r1 reads a model's output as reasoning until </think>: SmolLM2 never writes it,
    # so all of its output is thinking, which shows where the blocks go.
    gw = start_gateway(mesh, "--reasoning-parser", "deepseek_r1")
    yield anthropic.Anthropic(base_url=f"http://127.0.0.1:{gw.http_port}", api_key="unused",
                              timeout=120, max_retries=0)
    gw.stop()


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# -- messages.create ---------------------------------------------------------------------------

def test_create_answers_a_multi_turn_conversation_with_a_system_prompt(client, mesh):
    r = client.messages.create(model=mesh.model_name, system=SYSTEM, messages=TURNS,
                               max_tokens=16, extra_body=T0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r._request_id   # Anthropic's request-id header
    assert r.model == mesh.model_name
    assert [b.type for b in r.content] == ["text"] and _text(r).strip()
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 1 <= r.usage.output_tokens <= 16
    # The prompt as the gateway sent it: the same count as count_tokens and as /tokenize of
    # the equivalent chat (the system prompt is in it).
    sent = r.usage.input_tokens + r.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model=mesh.model_name, system=SYSTEM, messages=TURNS)
    chat = [{"role": "system", "content": SYSTEM}, TURNS[0], TURNS[1],
            {"role": "user", "content": "Name a colour."}]
    tok = httpx.post(f"{mesh.http_url}/tokenize", json={"messages": chat}, timeout=60).json()
    assert counted.input_tokens == sent == tok["count"]
    longer = client.messages.count_tokens(model=mesh.model_name, messages=TURNS,
                                          system=[{"type": "text", "text": SYSTEM},
                                                  {"type": "text", "text": "Answer in one word."}])
    assert longer.input_tokens > counted.input_tokens


def test_max_tokens_ends_the_message_with_stop_reason_max_tokens(client, mesh):
    r = client.messages.create(model=mesh.model_name, messages=COUNT, max_tokens=3, extra_body=T0)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3 and _text(r)


def test_a_stop_sequence_ends_the_message_and_is_named(client, mesh):
    free = _text(client.messages.create(model=mesh.model_name, messages=COUNT, max_tokens=30,
                                        extra_body=T0))
    assert " 5" in free, free
    r = client.messages.create(model=mesh.model_name, messages=COUNT, max_tokens=30, extra_body=T0,
                               stop_sequences=["never-there", " 5"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " 5"
    assert _text(r) == free[:free.index(" 5")]


def test_greedy_and_top_k_1_sampling_give_the_same_message(client, mesh):
    kw = dict(model=mesh.model_name, messages=TURNS, max_tokens=12)
    greedy = _text(client.messages.create(extra_body=T0, **kw))
    assert _text(client.messages.create(extra_body=T0, **kw)) == greedy
    # Sampling fields the 2.x client no longer types (older API versions have them): extra_body.
    assert _text(client.messages.create(extra_body={"temperature": 1.0, "top_k": 1}, **kw)) == greedy
    assert _text(client.messages.create(
        extra_body={"temperature": 1.0, "top_p": 0.5, "top_k": 1}, **kw)) == greedy


def test_a_prefilled_assistant_turn_is_continued(client, mesh):
    prefill = [*COUNT, {"role": "assistant", "content": "1 2 3"}]
    r = client.messages.create(model=mesh.model_name, messages=prefill, max_tokens=6, extra_body=T0)
    assert _text(r).lstrip().startswith("4"), _text(r)


# -- messages.stream ---------------------------------------------------------------------------

def test_streamed_events_come_in_order_and_assemble_the_created_message(client, mesh):
    kw = dict(model=mesh.model_name, system=SYSTEM, messages=TURNS, max_tokens=16, extra_body=T0)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e for e in stream if e.type in (
            "message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop")]
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.stop_reason is None and events[0].message.content == []
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # Prefix-cache hits may differ between the two runs; the whole prompt may not.
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_raw_stream_names_each_event_and_starts_with_a_ping(mesh):
    body = {"model": mesh.model_name, "messages": COUNT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{mesh.http_url}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"] == 4


def test_closing_a_stream_aborts_the_request_in_the_scheduler(mesh):
    body = {"model": mesh.model_name, "max_tokens": 1500, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by spaces."}]}
    with httpx.stream("POST", f"{mesh.http_url}/v1/messages", json=body, timeout=60) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas >= 3:
                break
        assert scheduler_load(mesh).num_running == 1
    assert wait_idle(mesh) < 5.0


def test_output_config_format_constrains_the_text_to_the_schema(client, mesh):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    r = client.messages.create(model=mesh.model_name, messages=TURNS, max_tokens=40, extra_body=T0,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(_text(r)), schema)


def test_thinking_comes_back_as_thinking_blocks_whole_and_streamed(reasoning_client, mesh):
    kw = dict(model=mesh.model_name, messages=COUNT, max_tokens=8, extra_body=T0)
    whole = reasoning_client.messages.create(thinking={"type": "adaptive"}, **kw)
    [block] = whole.content
    assert block.type == "thinking" and block.thinking.strip() and block.signature == ""
    assert whole.stop_reason == "max_tokens"
    with reasoning_client.messages.stream(thinking={"type": "adaptive"}, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta", "signature_delta"}
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == block.thinking
    assert final.content == whole.content
    # Not asked for: the reasoning is neither thinking nor text.
    hidden = reasoning_client.messages.create(thinking={"type": "disabled"}, **kw)
    assert hidden.content == [] and hidden.usage.output_tokens == 8


# -- errors ------------------------------------------------------------------------------------

def _post(mesh, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{mesh.http_url}{path}", json=body, timeout=60)


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["request_id"]
    return body["error"]["message"]


def test_an_image_block_is_a_400_naming_the_block(client, mesh):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=mesh.model_name, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert err.value.status_code == 400
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.1" in err.value.message and "image" in err.value.message


@pytest.mark.parametrize("change, named", [
    ({"max_tokens": None}, "max_tokens"),                  # required, as Anthropic requires
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"frobnicate": 1}, "frobnicate"),                     # unknown fields are refused
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"tools": [WEATHER]}, "tools"),                       # no --tool-call-parser on this mesh
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v)
def test_bad_input_is_an_anthropic_400_naming_the_field(mesh, change, named):
    body = {"model": mesh.model_name, "messages": COUNT, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    assert named in _anthropic_error(_post(mesh, body), 400, "invalid_request_error")


def test_an_unknown_model_is_an_anthropic_404(mesh):
    body = {"model": "claude-nonexistent", "messages": COUNT, "max_tokens": 4}
    _anthropic_error(_post(mesh, body), 404, "not_found_error")
    _anthropic_error(_post(mesh, {k: body[k] for k in ("model", "messages")},
                           "/v1/messages/count_tokens"), 404, "not_found_error")


# -- tools and x-api-key (keyed gateway with --tool-call-parser hermes) -------------------------

def test_x_api_key_authenticates_and_a_wrong_key_is_a_401(keyed, mesh, keyed_client):
    r = keyed_client.messages.create(model=mesh.model_name, messages=COUNT, max_tokens=2)
    assert r.usage.output_tokens == 2
    base = f"http://127.0.0.1:{keyed.http_port}/v1/messages"
    body = {"model": mesh.model_name, "messages": COUNT, "max_tokens": 2}
    assert httpx.post(base, json=body, headers={"authorization": f"Bearer {KEY}"},
                      timeout=60).status_code == 200
    for headers in ({}, {"x-api-key": "wrong-key-0000"}):
        refused = httpx.post(base, json=body, headers=headers, timeout=60)
        _anthropic_error(refused, 401, "authentication_error")
    # x-api-key is the Messages API's header only.
    r = httpx.post(f"http://127.0.0.1:{keyed.http_port}/v1/completions", headers={"x-api-key": KEY},
                   json={"model": mesh.model_name, "prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{keyed.http_port}", api_key="wrong-key-0000",
                            max_retries=0).messages.create(model=mesh.model_name, messages=COUNT,
                                                           max_tokens=2)


def _tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("choice, name, question", [
    ({"type": "any"}, None, ASK[0]["content"]),
    ({"type": "tool", "name": "get_time"}, "get_time", "What time is it in Tokyo?")],
    ids=["any", "tool"])
def test_a_forced_tool_choice_returns_a_tool_use_whose_input_validates(keyed_client, mesh, choice,
                                                                        name, question):
    r = keyed_client.messages.create(model=mesh.model_name, system=TOOL_SYSTEM,
                                     messages=[{"role": "user", "content": question}],
                                     tools=[WEATHER, TIME],
                                     tool_choice={**choice, "disable_parallel_tool_use": True},
                                     max_tokens=60, extra_body=T0)
    assert r.stop_reason == "tool_use", r.content
    [use] = _tool_uses(r)
    assert use.id.startswith("toolu_") and use.name in {"get_weather", "get_time"}
    if name:
        assert use.name == name
    schema = (WEATHER if use.name == "get_weather" else TIME)["input_schema"]
    jsonschema.validate(use.input, schema)


def test_a_streamed_tool_use_assembles_its_input_from_json_deltas(keyed_client, mesh):
    kw = dict(model=mesh.model_name, system=TOOL_SYSTEM, messages=ASK, tools=[WEATHER],
              max_tokens=60, extra_body=T0,
              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    with keyed_client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].content_block.id.startswith("toolu_")
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    [use] = _tool_uses(final)
    assert json.loads(partial) == use.input and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert use.input == _tool_uses(keyed_client.messages.create(**kw))[0].input


def test_a_tool_result_round_trip_is_rendered_and_answered(keyed_client, mesh):
    first = keyed_client.messages.create(model=mesh.model_name, system=TOOL_SYSTEM, messages=ASK,
                                         tools=[WEATHER], max_tokens=60, extra_body=T0,
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [use] = _tool_uses(first)

    def conversation(result: str) -> list:
        return [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": [{"type": "text", "text": result}]}]}]

    kw = dict(model=mesh.model_name, system=TOOL_SYSTEM, tools=[WEATHER])
    answer = keyed_client.messages.create(messages=conversation("Sunny, 25 C"), max_tokens=20,
                                          extra_body=T0, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    # The result is in the prompt the gateway sent: a longer result counts more tokens.
    short = keyed_client.messages.count_tokens(messages=conversation("Sunny"), **kw).input_tokens
    long = keyed_client.messages.count_tokens(messages=conversation("Sunny, 25 C"), **kw).input_tokens
    assert long > short
    assert long == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    # A result for a tool_use no assistant turn made is refused.
    bad = conversation("x")
    bad[-1]["content"][0]["tool_use_id"] = "toolu_unknown"
    with pytest.raises(anthropic.BadRequestError) as err:
        keyed_client.messages.create(messages=bad, max_tokens=4, **kw)
    assert "tool_use_id" in err.value.message or "toolu_unknown" in err.value.message
