"""The newer tool-call formats end to end, through the official openai client: a second gateway
(--tool-call-parser NAME) in front of the shared SmolLM2 mesh, and a one-shot example in that
parser's format that greedy SmolLM2 copies. What this proves is the wiring of each parser into
the chat route (special tokens kept for the formats that need them, the tool schema typing the
XML parameters, arguments streamed in fragments); the formats themselves are pinned on golden
text by tests/unit/test_parsers_golden.py."""
from __future__ import annotations

import concurrent.futures
import json

import pytest
from openai import OpenAI

from tests.integration.gateway_proc import start_gateway

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
SHOTS = {
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "deepseek_v31": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
}


def _messages(shot: str) -> list[dict]:
    return [{"role": "system", "content": "You call tools. To get weather, answer ONLY with a tool call like:\n" + shot},
            {"role": "user", "content": "Weather in Paris for 3 days?"},
            {"role": "assistant", "content": shot},
            {"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def clients(mesh):
    with concurrent.futures.ThreadPoolExecutor(len(SHOTS)) as pool:
        gateways = dict(zip(SHOTS, pool.map(lambda name: start_gateway(mesh, "--tool-call-parser", name), SHOTS)))
    yield {name: OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", timeout=120,
                        max_retries=0) for name, gw in gateways.items()}
    for gw in gateways.values():
        gw.stop()


@pytest.fixture(scope="module")
def answers(clients, mesh):
    """Every parser's whole and streamed answer, all asked at once (the engine batches the eight
    sequences; one or two at a time cost nearly as much each): {parser: (whole, chunks) futures}."""
    def ask(parser: str, stream: bool):
        args = dict(model=mesh.model_name, messages=_messages(SHOTS[parser]), tools=TOOLS, max_tokens=128,
                    temperature=0)
        if stream:
            return list(clients[parser].chat.completions.create(stream=True, **args))
        return clients[parser].chat.completions.create(**args).choices[0]
    with concurrent.futures.ThreadPoolExecutor(2 * len(SHOTS)) as pool:
        yield {parser: (pool.submit(ask, parser, False), pool.submit(ask, parser, True)) for parser in SHOTS}


@pytest.mark.parametrize("parser", sorted(SHOTS))
def test_a_call_in_the_parsers_format_comes_back_as_tool_calls_whole_and_streamed(answers, parser):
    whole, chunks = (f.result(timeout=240) for f in answers[parser])
    assert whole.finish_reason == "tool_calls", whole
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and not whole.message.content
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}   # days typed by the schema

    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    fragments = [d.function.arguments for d in deltas[1:] if d.function.arguments]
    assert len(fragments) > 1 and "".join(fragments) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if parser == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()
    if parser == "kimi_k2":
        assert call.id == deltas[0].id == "functions.get_weather:0"      # the model's own id
