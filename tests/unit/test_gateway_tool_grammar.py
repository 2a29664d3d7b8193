"""tool_choice required / named as a grammar: what it accepts is exactly what the tool-call parsers
turn into calls of allowed tools with arguments that validate; what breaks the format, names
another tool or breaks a schema is refused token by token (llguidance with SmolLM2's tokenizer)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer, grammar_from
from tokenizers import Tokenizer

from services.gateway.errors import ApiError
from services.gateway.openai.chat_tools import plan_tools
from services.gateway.openai.tool_grammar import tool_call_grammar
from services.gateway.parsers import make_output_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir):
    path = smollm2_dir / "tokenizer.json"
    return LLTokenizer(path.read_text(), eos_token=[2]), Tokenizer.from_file(str(path))


def accepts(tokenizers, grammar: str, text: str) -> bool:
    """Does the grammar take `text` whole (every token, and then the end)?"""
    ll, hf = tokenizers
    m = LLMatcher(ll, grammar_from("lark", grammar))
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in hf.encode(text).ids) and m.is_accepting()


@pytest.mark.parametrize("parser,reasoning,text", [
    ("hermes", None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    ("llama3_json", None, '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                          '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("qwen3_coder", None, "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                          "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n12\n"
                          "</parameter>\n<parameter=b>\n-3\n</parameter>\n</function>\n</tool_call>"),
    ("hermes", "qwen3", '<think>the user wants a sum</think><tool_call>\n'
                        '{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'),
    ("hermes", "deepseek_r1", 'a sum, then</think><tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}'
                              '\n</tool_call>'),
])
def test_what_the_grammar_accepts_parses_into_valid_calls(tokenizers, parser, reasoning, text):
    grammar = tool_call_grammar(TOOLS, {"get_weather", "add"}, parser, reasoning)
    assert LLMatcher.validate_grammar(grammar_from("lark", grammar)) == ""
    assert accepts(tokenizers, grammar, text)
    parsed = make_output_parser(reasoning, parser, allowed_tools={"get_weather", "add"}).parse(text)
    assert parsed.tool_calls
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("text", [
    "Sure, here is the weather.",                                                           # no call
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # not allowed
    '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>',        # breaks the schema
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',                    # misses "b"
])
def test_the_grammar_refuses_text_calls_to_other_tools_and_bad_arguments(tokenizers, text):
    assert not accepts(tokenizers, tool_call_grammar(TOOLS, {"add"}, "hermes"), text)


def test_one_call_only_without_parallel_tool_calls(tokenizers):
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    grammar = tool_call_grammar(TOOLS, {"add"}, "hermes", parallel=False)
    assert accepts(tokenizers, grammar, one)
    assert not accepts(tokenizers, grammar, one + "\n" + one)


def test_required_and_named_choices_are_forced_and_auto_is_free():
    assert plan_tools(TOOLS, "required", "hermes").forced
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, "hermes")
    assert named.forced and named.allowed_names == {"add"}
    assert not plan_tools(TOOLS, "auto", "hermes").forced


def test_tools_that_cannot_be_enforced_are_refused():
    with pytest.raises(ApiError) as err:
        tool_call_grammar(TOOLS, {"add"}, "pythonic")
    assert err.value.param == "tool_choice"
    bad = [{"type": "function", "function": {"name": "x", "parameters": [1, 2]}}]
    with pytest.raises(ApiError) as err:
        tool_call_grammar(bad, {"x"}, "hermes")
    assert err.value.param == "tools"


XML_TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "kind": {"enum": ["hotel", "flat"]},
                                     "extras": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "nights"]}}}]


@pytest.mark.parametrize("text, ok", [
    ("<tool_call>\n<function=book>\n<parameter=city>\nParis\n</parameter>\n<parameter=nights>\n3\n"
     "</parameter>\n</function>\n</tool_call>", True),
    ("<tool_call>\n<function=book>\n<parameter=city>\nOslo\n</parameter>\n<parameter=nights>\n2\n</parameter>\n"
     "<parameter=kind>\nflat\n</parameter>\n<parameter=extras>\n[\"wifi\"]\n</parameter>\n</function>\n"
     "</tool_call>", True),
    ("<tool_call>\n<function=book>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", False),
    ("<tool_call>\n<function=book>\n<parameter=city>\nParis\n</parameter>\n<parameter=nights>\nten\n"
     "</parameter>\n</function>\n</tool_call>", False),
    ("<tool_call>\n<function=book>\n<parameter=city>\nAmsterdam-Noord\n</parameter>\n<parameter=nights>\n3\n"
     "</parameter>\n</function>\n</tool_call>", False),                     # past maxLength
    ("<tool_call>\n<function=book>\n<parameter=city>\nRome\n</parameter>\n<parameter=nights>\n3\n"
     "</parameter>\n<parameter=kind>\ntent\n</parameter>\n</function>\n</tool_call>", False),   # not in the enum
    ("<tool_call>\n<function=book>\n<parameter=city>\n<parameter=x\n</parameter>\n<parameter=nights>\n3\n"
     "</parameter>\n</function>\n</tool_call>", False),            # a marker inside a value would split it
    ("<tool_call>\n<function=book>\n<parameter=city>\na <b>\nc\n</parameter>\n<parameter=nights>\n3\n"
     "</parameter>\n</function>\n</tool_call>", True),             # other markup and newlines are text
])
def test_qwen3_coder_calls_are_typed_and_bounded_by_the_schema(tokenizers, text, ok):
    grammar = tool_call_grammar(XML_TOOLS, {"book"}, "qwen3_coder", parallel=False)
    assert accepts(tokenizers, grammar, text) is ok
    if ok:
        [call] = make_output_parser(None, "qwen3_coder", allowed_tools={"book"}, tools=XML_TOOLS).parse(text).tool_calls
        jsonschema.validate(json.loads(call.arguments), XML_TOOLS[0]["function"]["parameters"])
