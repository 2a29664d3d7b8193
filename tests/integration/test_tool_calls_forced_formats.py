"""tool_choice required / named with the llama3_json and qwen3_coder tool-call parsers: a second
gateway per parser in front of the shared mesh. The forced output is Llama 3's JSON call format
({"name": ..., "parameters": {...}}) or Qwen3-Coder's XML (<tool_call><function=...><parameter=...>);
every returned call parses, names an allowed tool and validates against its schema, whole and
streamed. (hermes: test_tool_calls_e2e.py.)"""
from __future__ import annotations

import concurrent.futures
import json

import pytest
from openai import OpenAI

from tests.integration.gateway_proc import start_gateway
from tests.integration.test_tool_calls_e2e import CHAT, FORCED_TOOLS, _assert_valid_calls, streamed_calls

PARSERS = ["llama3_json", "qwen3_coder"]
CHOICES = [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
]


@pytest.fixture(scope="module")
def clients(mesh):
    with concurrent.futures.ThreadPoolExecutor(len(PARSERS)) as pool:
        starts = {p: pool.submit(start_gateway, mesh, "--tool-call-parser", p) for p in PARSERS}
    gateways = {p: f.result() for p, f in starts.items() if not f.exception()}
    try:
        for f in starts.values():
            f.result()   # a gateway that failed to start fails the module (the others are stopped below)
        yield {p: OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", timeout=120,
                         max_retries=0) for p, gw in gateways.items()}
    finally:
        for gw in gateways.values():
            gw.stop()


@pytest.fixture(scope="module")
def answers(clients, mesh):
    """Every request of this file, sent at once (the engine batches the six sequences; one at a
    time, each costs nearly as much as all of them together): {(parser, kind): future}, kind the
    JSON of a forced tool_choice or "stream"."""
    def whole(parser: str, tool_choice):
        return clients[parser].chat.completions.create(
            model=mesh.model_name, messages=CHAT, tools=FORCED_TOOLS, tool_choice=tool_choice, max_tokens=96,
            temperature=0, parallel_tool_calls=False)

    def streamed(parser: str):
        return list(clients[parser].chat.completions.create(
            model=mesh.model_name, messages=CHAT, tools=FORCED_TOOLS, tool_choice="required", max_tokens=128,
            temperature=0.8, seed=3, stream=True))
    with concurrent.futures.ThreadPoolExecutor(len(PARSERS) * (len(CHOICES) + 1)) as pool:
        futures = {(p, json.dumps(choice)): pool.submit(whole, p, choice) for p in PARSERS for choice, _ in CHOICES}
        futures.update({(p, "stream"): pool.submit(streamed, p) for p in PARSERS})
        yield futures


@pytest.mark.parametrize("tool_choice,allowed", CHOICES)
@pytest.mark.parametrize("parser", PARSERS)
def test_forced_calls_parse_and_validate(answers, parser, tool_choice, allowed):
    r = answers[parser, json.dumps(tool_choice)].result(timeout=240)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    _assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], allowed)


@pytest.mark.parametrize("parser", PARSERS)
def test_forced_calls_stream_and_validate_with_parallel_calls_allowed(answers, parser):
    chunks = answers[parser, "stream"].result(timeout=240)
    calls = streamed_calls(chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["length"]:      # several calls allowed: the last may be cut; the complete ones count
        calls.popitem()
    else:
        assert finish == ["tool_calls"]
    _assert_valid_calls([tuple(v) for v in calls.values()], {"get_weather", "add"})
