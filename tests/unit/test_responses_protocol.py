"""The Responses API request body: its conversion to the chat request that serves it, and the
400s (naming the field) for what this server does not do."""
import json

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai.protocol import parse_body
from services.gateway.openai.responses_protocol import (ResponsesRequest, chat_param,
                                                        input_items_of, input_messages,
                                                        resolve_references, to_chat_request)

TOOL = {"type": "function", "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(**kw) -> ResponsesRequest:
    return parse_body(ResponsesRequest, json.dumps(kw).encode())


def error_of(fn, *args) -> dict:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    assert exc.value.http_status == 400
    return exc.value.to_openai()["error"]


def test_string_input_is_one_user_turn_after_the_instructions():
    chat = to_chat_request(parse(input="Hi", instructions="Be brief", max_output_tokens=9,
                                 temperature=0.5), [])
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief"), ("user", "Hi")]
    sp = chat.to_sampling()
    assert sp.max_tokens == 9 and sp.temperature == pytest.approx(0.5)


def test_items_become_chat_turns_with_tool_calls_and_results():
    req = parse(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "two"}]}])
    msgs = input_messages(req.input)
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "tool"]
    assert msgs[1]["content"] == "a\nb"
    assert msgs[2]["content"] == "calling"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{\"x\": 1}"}
    assert (msgs[3]["tool_call_id"], msgs[4]["content"]) == ("call_1", "two")
    wire = to_chat_request(req, []).to_chat_messages()
    assert json.loads(wire[2].tool_calls_json)[1]["function"]["name"] == "g"


def test_history_comes_between_the_instructions_and_the_new_input():
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"}]
    chat = to_chat_request(parse(input="second", instructions="sys"), history)
    assert [m.content for m in chat.messages] == ["sys", "first", "reply", "second"]


def test_function_tools_and_a_named_choice_become_the_chat_shapes():
    chat = to_chat_request(parse(input="x", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False), [])
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": TOOL["parameters"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False


def test_text_format_json_schema_is_an_output_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sp = to_chat_request(parse(input="x", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}), []).to_sampling()
    assert json.loads(sp.structured.json_schema) == schema
    sp = to_chat_request(parse(input="x", text={"format": {"type": "json_object"}}), []).to_sampling()
    assert sp.structured.json_object
    assert not to_chat_request(parse(input="x", text={"format": {"type": "text"}}),
                               []).to_sampling().HasField("structured")
    err = error_of(to_chat_request, parse(input="x", text={"format": {"type": "json_schema"}}), [])
    assert err["param"] == "text"


def test_reasoning_effort_reaches_the_template_as_reasoning_effort():
    chat = to_chat_request(parse(input="x", reasoning={"effort": "low"}), [])
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


@pytest.mark.parametrize("field, value", [
    ("include", ["reasoning.encrypted_content"]),
    ("truncation", "auto"), ("max_tool_calls", 3), ("text", {"verbosity": "low"}),
    ("reasoning", {"summary": "auto"}), ("stream_options", {"include_obfuscation": True}),
])
def test_what_is_not_done_is_a_400_naming_the_field(field, value):
    err = error_of(to_chat_request, parse(input="x", stream=True, **{field: value}), [])
    assert err["param"] == field


@pytest.mark.parametrize("body, param, needle", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input", "input_file"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", ""),
    ({"input": 3}, "input", ""),
])
def test_bad_bodies_are_a_400_naming_the_field(body, param, needle):
    err = error_of(parse_body, ResponsesRequest, json.dumps(body).encode())
    assert err["param"] == param and needle in err["message"]


def test_chat_field_names_in_errors_become_the_responses_names():
    assert chat_param("max_completion_tokens") == "max_output_tokens"
    assert chat_param("messages") == "input" and chat_param("response_format") == "text"
    assert chat_param("temperature") == "temperature" and chat_param(None) is None
    err = error_of(lambda: to_chat_request(parse(input=[]), []).to_sampling())
    assert chat_param(err["param"]) == "input"


def test_a_background_response_must_be_stored():
    err = error_of(to_chat_request, parse(input="x", background=True, store=False), [])
    assert err["param"] == "background"
    to_chat_request(parse(input="x", background=True, stream=True), [])   # stored: fine


def test_a_value_the_chat_request_refuses_is_a_400_naming_it():
    err = error_of(to_chat_request, parse(input="x", seed=2 ** 64), [])
    assert err["param"] == "seed"


def test_input_items_are_listed_with_ids_and_text_parts():
    counter = iter(range(100))
    req = parse(input=[{"role": "user", "content": "hi"},
                       {"type": "message", "role": "assistant", "id": "msg_given", "content": "yo"},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c1", "output": "ok"}])
    items = input_items_of(req.input, lambda prefix: f"{prefix}_{next(counter)}")
    assert [i["id"] for i in items] == ["msg_0", "msg_given", "fc_1", "fco_2"]
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "yo"}]
    assert all(i["status"] == "completed" for i in items)
    [only] = input_items_of("plain", lambda prefix: prefix + "_x")
    assert (only["role"], only["content"][0]["text"]) == ("user", "plain")


def test_logprobs_come_on_by_include_or_top_logprobs():
    sp = to_chat_request(parse(input="x", include=["message.output_text.logprobs"]), []).to_sampling()
    assert sp.HasField("logprobs") and sp.logprobs == 0
    assert to_chat_request(parse(input="x", top_logprobs=3), []).to_sampling().logprobs == 3
    assert not to_chat_request(parse(input="x", top_logprobs=0), []).to_sampling().HasField("logprobs")


def test_item_references_become_the_stored_items_they_name():
    stored = {"msg_1": {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "earlier", "annotations": [],
                                     "logprobs": []}]},
              "fc_1": {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f",
                       "arguments": "{}", "status": "completed"}}
    req = parse(input=[{"type": "item_reference", "id": "msg_1"},
                       {"type": "item_reference", "id": "fc_1"}, {"role": "user", "content": "now"}])
    items = resolve_references(req.input, stored.get)
    msgs = input_messages(items)
    assert [(m["role"], m["content"]) for m in msgs] == [("assistant", "earlier"), ("user", "now")]
    assert msgs[0]["tool_calls"][0]["id"] == "c"
    err = error_of(resolve_references, parse(input=[{"type": "item_reference", "id": "x"}]).input,
                   stored.get)
    assert err["param"] == "input" and "'x'" in err["message"]
