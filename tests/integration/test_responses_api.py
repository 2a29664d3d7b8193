"""The Responses API end to end with the official openai client and the real SmolLM2 mesh:
whole and streamed responses, instructions, max_output_tokens -> incomplete, structured output
through text.format, multi-turn state through previous_response_id, store false, retrieve,
delete, cancel; enforced tool calls and a tool round trip through a gateway with a tool-call parser."""
from __future__ import annotations

import json
import threading
import time

import jsonschema
import openai
import pydantic
import pytest
from openai import OpenAI

from tests.integration.gateway_proc import start_gateway

LONG = "Write a long story about a dragon who learns to cook."


@pytest.fixture(scope="module")
def client(mesh):
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_a_string_input_gets_a_completed_message_with_usage(client, mesh):
    r = client.responses.create(model=mesh.model_name, input="Say hello.", max_output_tokens=24,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == mesh.model_name
    assert r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert r.output_text and item.content[0].text == r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is True and r.temperature == 0


def test_messages_input_with_instructions_reaches_the_prompt(client, mesh):
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Name a colour."}]
    def ask(instructions):
        return client.responses.create(model=mesh.model_name, input=messages, max_output_tokens=4,
                                       temperature=0, store=False, instructions=instructions)
    short = ask("Be brief.")
    told = ask("You are a painter who lives by the sea and loves blue, green and every colour of "
               "the evening sky. Answer with one word.")
    assert told.instructions.startswith("You are a painter")
    assert told.usage.input_tokens > short.usage.input_tokens + 20


def test_input_tokens_counts_the_prompt_a_response_would_have(client, mesh):
    args = dict(model=mesh.model_name, instructions="Be brief.",
                input=[{"role": "user", "content": "Name a colour."}])
    counted = client.responses.input_tokens.count(**args)
    r = client.responses.create(**args, max_output_tokens=1, store=False)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == r.usage.input_tokens > 0


def test_max_output_tokens_makes_an_incomplete_response(client, mesh):
    r = client.responses.create(model=mesh.model_name, input=LONG, max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_text_format_json_schema_gives_valid_json(client, mesh):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    r = client.responses.create(
        model=mesh.model_name, input="Invent a person. Reply in JSON.", max_output_tokens=80,
        temperature=0, text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                        "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_responses_parse_fills_output_parsed_from_a_pydantic_model(client, mesh):
    class Colour(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        warm: bool

    r = client.responses.parse(model=mesh.model_name, input="Name a colour, in JSON.",
                               text_format=Colour, max_output_tokens=60, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Colour)


def test_previous_response_id_continues_the_conversation(client, mesh):
    first = client.responses.create(model=mesh.model_name, input="My name is Ada.",
                                    instructions="Be brief.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=mesh.model_name, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    alone = client.responses.create(model=mesh.model_name, input="What is my name?",
                                    max_output_tokens=8, temperature=0, store=False)
    assert second.previous_response_id == first.id
    page = client.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in page.data] == ["What is my name?"]   # its own input
    # The second prompt holds the first turn and its answer (not the first's instructions).
    grown = second.usage.input_tokens - alone.usage.input_tokens
    assert grown >= first.usage.output_tokens + 3
    assert second.usage.input_tokens < first.usage.input_tokens + first.usage.output_tokens + \
        alone.usage.input_tokens


def test_an_item_reference_brings_a_stored_item_into_the_input(client, mesh):
    first = client.responses.create(model=mesh.model_name, input="Say a long sentence.",
                                    max_output_tokens=12, temperature=0)
    question = {"role": "user", "content": "Repeat it."}
    ref = {"type": "item_reference", "id": first.output[0].id}
    with_ref = client.responses.input_tokens.count(model=mesh.model_name, input=[ref, question])
    alone = client.responses.input_tokens.count(model=mesh.model_name, input=[question])
    assert with_ref.input_tokens >= alone.input_tokens + first.usage.output_tokens - 2
    r = client.responses.create(model=mesh.model_name, input=[ref, question], max_output_tokens=2)
    assert r.usage.input_tokens == with_ref.input_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=mesh.model_name, max_output_tokens=2,
                                input=[{"type": "item_reference", "id": "msg_unknown"}])
    assert exc.value.body["param"] == "input"


def test_store_false_is_neither_retrievable_nor_a_previous_response(client, mesh):
    r = client.responses.create(model=mesh.model_name, input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=mesh.model_name, input="Hi", previous_response_id=r.id,
                                max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id"


def test_retrieve_returns_the_stored_response_and_delete_removes_it(client, mesh):
    r = client.responses.create(model=mesh.model_name, input="Count to three.",
                                max_output_tokens=6, temperature=0, metadata={"case": "retrieve"})
    got = client.responses.retrieve(r.id)
    assert (got.id, got.status, got.output_text, got.metadata) == \
        (r.id, r.status, r.output_text, {"case": "retrieve"})
    assert got.usage.output_tokens == r.usage.output_tokens
    with pytest.raises(openai.BadRequestError):   # it is over: nothing to cancel
        client.responses.cancel(r.id)
    [item] = client.responses.input_items.list(r.id).data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", "Count to three.")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_stream_has_the_events_in_order_and_its_deltas_make_the_text(client, mesh):
    with client.responses.stream(model=mesh.model_name, max_output_tokens=64, temperature=0,
                                 input="Answer with one word: what colour is the sky?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text == events[-4].text
    assert final.status == "completed" and final.usage.output_tokens < 64
    assert client.responses.retrieve(final.id).output_text == text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client, mesh):
    events = list(client.responses.create(model=mesh.model_name, input=LONG, max_output_tokens=3,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_cancel_stops_a_running_stream(client, mesh):
    stream = client.responses.create(model=mesh.model_name, input=LONG, max_output_tokens=400,
                                     temperature=0, stream=True)
    events, cancelled = [], {}
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and not cancelled:
            worker = threading.Thread(target=lambda: cancelled.update(
                r=client.responses.cancel(events[0].response.id)))
            worker.start()
            worker.join(30)
    assert cancelled["r"].status == "cancelled"
    assert events[-1].type == "response.failed" and events[-1].response.status == "cancelled"
    got = client.responses.retrieve(events[0].response.id)
    assert got.status == "cancelled" and got.usage.output_tokens < 400


def _wait_until_over(client, response_id, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_a_background_response_runs_without_the_client_and_is_polled(client, mesh):
    r = client.responses.create(model=mesh.model_name, input="Say hello.", max_output_tokens=8,
                                temperature=0, background=True)
    assert r.background is True and r.status == "queued" and r.output == []
    done = _wait_until_over(client, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert 0 < done.usage.output_tokens <= 8


def test_cancel_stops_a_background_response_and_a_second_cancel_changes_nothing(client, mesh):
    r = client.responses.create(model=mesh.model_name, input=LONG, max_output_tokens=400,
                                temperature=0, background=True)
    deadline = time.monotonic() + 30
    while not (running := client.responses.retrieve(r.id)).output_text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.status == "in_progress" and running.output_text   # the output so far
    cancelled = client.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "cancelled"
    got = client.responses.retrieve(r.id)
    assert got.status == "cancelled" and got.usage.output_tokens < 400
    assert client.responses.cancel(r.id).status == "cancelled"   # over: returned unchanged


def test_logprobs_come_with_the_text_whole_and_streamed(client, mesh):
    args = dict(model=mesh.model_name, input=LONG, max_output_tokens=5, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2, store=False)
    part = client.responses.create(**args).output[0].content[0]
    assert len(part.logprobs) == 5 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(lp.logprob <= 0 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
               for lp in part.logprobs)
    events = list(client.responses.create(stream=True, **args))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]


def test_a_streamed_background_response_can_be_streamed_again_from_any_event(client, mesh):
    events = list(client.responses.create(model=mesh.model_name, input=LONG, max_output_tokens=12,
                                          temperature=0, background=True, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    response_id = events[0].response.id
    tail = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [(e.sequence_number, e.type) for e in tail] == \
        [(e.sequence_number, e.type) for e in events[4:]]
    assert tail[-1].response.output_text == client.responses.retrieve(response_id).output_text
    foreground = client.responses.create(model=mesh.model_name, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        list(client.responses.retrieve(foreground.id, stream=True))
    assert exc.value.body["param"] == "stream"


def test_unsupported_fields_are_a_400_naming_them(client, mesh):
    for kwargs, param in (({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"background": True, "store": False}, "background"),
                          ({"input": [{"role": "user", "content": [
                              {"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
                          ({"include": ["reasoning.encrypted_content"]}, "include")):
        body = {"model": mesh.model_name, "input": "Hi", "max_output_tokens": 2, **kwargs}
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(**body)
        assert exc.value.body["param"] == param, exc.value.body


KEY_A, KEY_B = "responses-key-a-0001", "responses-key-b-0002"


@pytest.fixture(scope="module")
def keyed_gateway(mesh):
    """A second gateway (no model load) before the shared mesh: two API keys, and the
    deepseek_r1 reasoning parser (with no </think> in the output, all of it is reasoning)."""
    gw = start_gateway(mesh, "--api-key", KEY_A, "--api-key", KEY_B,
                       "--reasoning-parser", "deepseek_r1")
    yield gw
    gw.stop()


def _as_key(gw, key):
    return OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key=key, timeout=60,
                  max_retries=0)


def test_one_api_key_cannot_reach_another_keys_responses(keyed_gateway, mesh):
    a, b = _as_key(keyed_gateway, KEY_A), _as_key(keyed_gateway, KEY_B)
    r = a.responses.create(model=mesh.model_name, input="Hi", max_output_tokens=2)
    assert a.responses.retrieve(r.id).id == r.id
    for attempt in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                    lambda: b.responses.cancel(r.id),
                    lambda: b.responses.create(model=mesh.model_name, input="Hi",
                                               previous_response_id=r.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert a.responses.retrieve(r.id).status == r.status   # still there for its owner


def test_the_reasoning_parser_gives_a_reasoning_item_whole_and_streamed(keyed_gateway, mesh):
    client = _as_key(keyed_gateway, KEY_A)
    args = dict(model=mesh.model_name, input="Hello", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**args)
    [item] = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    reasoning = item.content[0].text
    assert reasoning and item.content[0].type == "reasoning_text"
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens + 1
    events = list(client.responses.create(stream=True, **args))
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[3].part.type == "reasoning_text"
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning == next(e for e in events
                                         if e.type == "response.reasoning_text.done").text
    assert "response.output_text.delta" not in types
    assert events[-1].response.output[0].content[0].text == reasoning


TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}
SHOT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_INPUT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_client(mesh):
    """A gateway with --tool-call-parser hermes in front of the shared mesh."""
    gw = start_gateway(mesh, "--tool-call-parser", "hermes")
    yield OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", timeout=120, max_retries=0), mesh
    gw.stop()


def test_tool_choice_required_gives_a_function_call_that_validates(tool_client):
    client, m = tool_client
    r = client.responses.create(model=m.model_name, input=TOOL_INPUT, tools=[TOOL],
                                tool_choice="required", parallel_tool_calls=False,
                                instructions="You call tools like:\n" + SHOT,
                                max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    # The tool's result continues the conversation (previous_response_id + function_call_output).
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    after = client.responses.create(model=m.model_name, previous_response_id=r.id, tools=[TOOL],
                                    input=result, max_output_tokens=12, temperature=0)
    bare = client.responses.create(model=m.model_name, tools=[TOOL], input=result,
                                   max_output_tokens=1, store=False)
    assert after.status in ("completed", "incomplete") and after.output
    assert after.usage.input_tokens > bare.usage.input_tokens   # the earlier turns came along


def test_an_enforced_tool_choice_and_a_text_format_are_refused_together(tool_client):
    client, m = tool_client
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=m.model_name, input="x", tools=[TOOL], tool_choice="required",
                                text={"format": {"type": "json_object"}}, max_output_tokens=4)
    assert exc.value.body["param"] == "tool_choice" and "text.format" in exc.value.body["message"]


def test_a_streamed_function_call_assembles_to_its_arguments(tool_client):
    client, m = tool_client
    with client.responses.stream(model=m.model_name, input=TOOL_INPUT, tools=[TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False, instructions="You call tools like:\n" + SHOT,
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    call = next(o for o in final.output if o.type == "function_call")
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    assert events[-1].type == "response.completed"
