"""Parsers, tools and template arguments through a mesh started with
--reasoning-parser deepseek_r1 --tool-call-parser hermes --chat-template FILE.

What is proven here is the wiring: the reasoning parser on real output (stream and whole
agree), tools / tool messages / chat_template_kwargs reaching the template, and the
validation. A real model-made tool call is in test_tool_calls_e2e.py; the parsers' own
logic is pinned by tests/unit/test_parser_conformance.py."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.integration.meshproc import start_mesh

TEMPLATE = """{%- if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}
{% endif %}{% if enable_thinking is defined %}THINKING={{ enable_thinking }}
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}{% if m.tool_call_id %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def parser_mesh(smollm2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    m = start_mesh(str(smollm2_dir), "--max-model-len", "1024", "--max-num-seqs", "8",
                   "--chat-template", str(path), "--reasoning-parser", "deepseek_r1",
                   "--tool-call-parser", "hermes")
    yield m
    assert m.stop() == 0


@pytest.fixture(scope="module")
def client(parser_mesh):
    return OpenAI(base_url=f"{parser_mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_reasoning_parser_moves_unclosed_thinking_into_reasoning_content(client, parser_mesh):
    args = dict(model=parser_mesh.model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and whole.message.content in ("", None)  # deepseek_r1: no </think> = all reasoning
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == reasoning
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tools_tool_messages_and_template_kwargs_reach_the_template(parser_mesh):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_7", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
    with httpx.Client(base_url=parser_mesh.http_url, timeout=60) as http:
        r = http.post("/tokenize", json={"messages": messages, "tools": [TOOL],
                                         "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text.startswith("TOOLS: get_weather") and "THINKING=False" in text
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
        assert "[call_7] sunny" in text
        bad = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"bos_token": "x"}})
        assert bad.status_code == 400 and "bos_token" in bad.json()["error"]["message"]


def test_tool_choice_is_validated(client, parser_mesh):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=parser_mesh.model_name, messages=msgs, tool_choice="required",
                                       max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=parser_mesh.model_name, messages=msgs, tools=[TOOL], max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=parser_mesh.model_name, messages=msgs, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    ok = client.chat.completions.create(model=parser_mesh.model_name, messages=msgs, tools=[TOOL],
                                        tool_choice="auto", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")  # SmolLM2 answers in text
