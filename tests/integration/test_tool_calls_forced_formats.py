"""tool_choice required / named with the llama3_json and qwen3_coder tool-call parsers: a second
gateway per parser in front of the shared mesh. The forced output is Llama 3's JSON call format
({"name": ..., "parameters": {...}}) or Qwen3-Coder's XML (<tool_call><function=...><parameter=...>);
every returned call parses, names an allowed tool and validates against its schema, whole and
streamed. (hermes: test_tool_calls_e2e.py.)"""
from __future__ import annotations

import pytest
from openai import OpenAI

from tests.integration.gateway_proc import start_gateway
from tests.integration.test_tool_calls_e2e import CHAT, FORCED_TOOLS, _assert_valid_calls, streamed_calls


@pytest.fixture(scope="module", params=["llama3_json", "qwen3_coder"])
def client(mesh, request):
    gw = start_gateway(mesh, "--tool-call-parser", request.param)
    yield OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", timeout=120, max_retries=0)
    gw.stop()


@pytest.mark.parametrize("tool_choice,allowed", [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
])
def test_forced_calls_parse_and_validate(client, mesh, tool_choice, allowed):
    r = client.chat.completions.create(model=mesh.model_name, messages=CHAT, tools=FORCED_TOOLS,
                                       tool_choice=tool_choice, max_tokens=96, temperature=0,
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    _assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], allowed)


def test_forced_calls_stream_and_validate_with_parallel_calls_allowed(client, mesh):
    chunks = list(client.chat.completions.create(
        model=mesh.model_name, messages=CHAT, tools=FORCED_TOOLS, tool_choice="required", max_tokens=128,
        temperature=0.8, seed=3, stream=True))
    calls = streamed_calls(chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["length"]:      # several calls allowed: the last may be cut; the complete ones count
        calls.popitem()
    else:
        assert finish == ["tool_calls"]
    _assert_valid_calls([tuple(v) for v in calls.values()], {"get_weather", "add"})
