"""Messages requests -> the gateway's chat (services/gateway/anthropic/protocol.py, convert.py):
the prompt's chat messages, the tool plan of each tool_choice, the SamplingParams, and the 400s
naming the field or block."""
from __future__ import annotations

import json

import pytest

from services.gateway.anthropic.convert import chat_prompt, stop_reason_of
from services.gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from services.gateway.errors import ApiError
from services.gateway.openai.protocol import parse_body

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "input_schema": {"type": "object"}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def _req(cls=MessagesRequest, **body) -> MessagesRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body}
    if cls is CountTokensRequest:
        body.pop("max_tokens")
    return parse_body(cls, json.dumps(body).encode())


def _refused(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args, **kwargs)
    assert err.value.http_status == 400
    return err.value


def _chat(req, tool_parser="hermes", reasoning=None):
    return chat_prompt(req, tool_parser, reasoning)


def test_system_turns_tool_use_and_tool_results_become_chat_messages():
    req = _req(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "No lists."}],
               messages=[
                   {"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, USE]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "25 C"}]},
                       {"type": "text", "text": "And tomorrow?"}]},
                   {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                     {**USE, "id": "toolu_2"}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                                 "content": "no data", "is_error": True}]}])
    prompt = _chat(req)
    got = [(m.role, m.content, m.tool_call_id) for m in prompt.messages]
    assert got == [("system", "Be brief.\nNo lists.", ""), ("user", "Weather?", ""),
                   ("assistant", "Checking.", ""), ("tool", "sunny\n25 C", "toolu_1"),
                   ("user", "And tomorrow?", ""), ("assistant", "", ""),
                   ("tool", "Error: no data", "toolu_2")]
    [call] = json.loads(prompt.messages[2].tool_calls_json)
    assert call == {"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert prompt.add_generation_prompt and not prompt.continue_final_message


def test_a_final_assistant_turn_is_a_prefill_continued_by_the_output():
    prompt = _chat(_req(messages=[{"role": "user", "content": "Count"},
                                  {"role": "assistant", "content": "1 2"}]))
    assert prompt.continue_final_message and not prompt.add_generation_prompt
    assert prompt.messages[-1].content == "1 2"


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": [{"type": "text", "text": "see"},
                                   {"type": "image", "source": {"type": "base64", "data": "x"}}]}],
     "messages.0.content.1: image"),
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}],
     "messages.0.content.0: document"),
    ([{"role": "assistant", "content": [USE]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
          {"type": "image", "source": {"type": "base64", "data": "x"}}]}]}],
     "messages.1.content.0.content.0: image"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
     "toolu_9"),
    ([{"role": "user", "content": [USE]}], "messages.0.content.0: tool_use blocks belong"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [USE]}],
     "ends on tool_use"),
    ([], "at least one message"),
])
def test_unreadable_or_inconsistent_content_is_a_400_naming_the_block(messages, where):
    err = _refused(_chat, _req(messages=messages, tools=[WEATHER]))
    assert where in err.message and err.param == "messages"


def test_tool_choice_any_and_tool_are_forced_auto_parses_and_none_renders_nothing():
    auto = _chat(_req(tools=[WEATHER, TIME])).plan
    assert not auto.forced and auto.parse_tool_calls and auto.allowed_names == {"get_weather", "get_time"}
    tools = json.loads(auto.tools_json)
    assert tools[0] == {"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": "Weather of a city"}}
    anyp = _chat(_req(tools=[WEATHER, TIME], tool_choice={"type": "any"}))
    assert anyp.plan.forced and anyp.plan.allowed_names == {"get_weather", "get_time"}
    assert anyp.parallel_tool_calls
    named = _chat(_req(tools=[WEATHER, TIME], tool_choice={
        "type": "tool", "name": "get_time", "disable_parallel_tool_use": True}))
    assert named.plan.forced and named.plan.allowed_names == {"get_time"}
    assert [t["function"]["name"] for t in json.loads(named.plan.tools_json)] == ["get_time"]
    assert not named.parallel_tool_calls
    none = _chat(_req(tools=[WEATHER], tool_choice={"type": "none"})).plan
    assert none.tools_json == "" and not none.parse_tool_calls


@pytest.mark.parametrize("body, param, text", [
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice",
     "names tool 'nope'"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools", "tools.0.input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "'any' needs a non-empty tools list"),
    ({"tool_choice": {"type": "auto"}}, "tool_choice", "tools"),
])
def test_bad_tools_are_a_400_naming_the_field(body, param, text):
    err = _refused(_chat, _req(**body))
    assert err.param == param and text in err.message


def test_tools_need_a_tool_call_parser_and_thinking_a_reasoning_parser():
    assert _refused(_chat, _req(tools=[WEATHER]), None).param == "tools"
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert _refused(_chat, _req(thinking=thinking, max_tokens=2048), None).param == "thinking"
    on = _chat(_req(thinking=thinking, max_tokens=2048), None, "qwen3")
    assert json.loads(on.template_kwargs_json) == {"enable_thinking": True}
    off = _chat(_req(), None, "qwen3")
    assert json.loads(off.template_kwargs_json) == {"enable_thinking": False}
    assert _chat(_req(), None, None).template_kwargs_json == ""


def test_sampling_params_carry_the_request():
    sp = _req(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["\n\n", "END"],
              max_tokens=64, metadata={"user_id": "u1"}, service_tier="auto").to_sampling()
    assert (sp.temperature, round(sp.top_p, 6), sp.top_k, sp.max_tokens) == (0.5, 0.9, 40, 64)
    assert list(sp.stop) == ["\n\n", "END"] and sp.skip_special_tokens
    assert not sp.HasField("structured")
    default = _req().to_sampling()
    assert (default.temperature, default.top_p, default.top_k) == (1.0, 1.0, 0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = _req(output_config={"format": {"type": "json_schema", "schema": schema}}).to_sampling()
    assert json.loads(fmt.structured.json_schema) == schema
    assert _req(max_tokens=0).rule_options().explicit_zeros == {"max_tokens"}


@pytest.mark.parametrize("body, named", [
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 2 ** 40}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 4096}, "thinking"),
])
def test_anthropic_ranges_are_a_400_naming_the_field(body, named):
    err = _refused(lambda: _req(**body).to_sampling())
    assert err.param == named


@pytest.mark.parametrize("body, named", [
    ({"max_tokens": None}, "max_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "required"}}, "tool_choice"),
])
def test_unknown_or_mistyped_fields_are_a_400_naming_them(body, named):
    full = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body}
    full = {k: v for k, v in full.items() if v is not None}
    err = _refused(parse_body, MessagesRequest, json.dumps(full).encode())
    assert err.param == named and named in err.message


def test_count_tokens_takes_the_prompt_fields_only():
    assert _chat(_req(CountTokensRequest, system="s")).messages[0].content == "s"
    body = json.dumps({"model": "m", "messages": [], "max_tokens": 3}).encode()
    assert _refused(parse_body, CountTokensRequest, body).param == "max_tokens"


def test_stop_reason_mapping():
    assert stop_reason_of("length", None, 1) == ("max_tokens", None)
    assert stop_reason_of("stop", "###", 0) == ("stop_sequence", "###")
    assert stop_reason_of("stop", None, 2) == ("tool_use", None)
    assert stop_reason_of("stop", None, 0) == ("end_turn", None)
