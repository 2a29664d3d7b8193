"""Golden outputs of the parsers added for issue 18, written from each model's published chat
template and tool-call format: the whole parse of each is pinned here, and
test_parser_conformance.py streams every one of them split at every boundary (the stream must
give exactly the whole parse, arguments included, fragment by fragment)."""
from __future__ import annotations

import itertools
import json

import pytest

from services.gateway.parsers import make_output_parser, needs_special_tokens

W = {"city": "Paris", "unit": "celsius"}
WJ = json.dumps(W)
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_EOS = "<｜end▁of▁sentence｜>"
KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}}]


def _ds3(name, args):
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def _ds31(name, args):
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


def _kimi(name, i, args):
    return f"{KIMI[2]}functions.{name}:{i}{KIMI[3]}{args}{KIMI[4]}"


QC = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
SEED = ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
        "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>")
H_ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
H_CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
          f"<|message|>{WJ}<|call|>")

# A call whose arguments come before its name cannot stream: it is read whole, then decided.
ARGS_FIRST = f'[TOOL_CALLS][{{"arguments": {WJ}, "name": "get_weather"}}]'

# (reasoning parser, tool parser) -> [(model output, (reasoning, content, [(name, arguments)]))]
GOLDEN = {
    (None, "deepseek_v3"): [
        (f"{DS_BEGIN}{_ds3('get_weather', WJ)}{DS_END}", ("", "", [("get_weather", WJ)])),
        (f"Checking.\n\n{DS_BEGIN}{_ds3('get_weather', WJ)}\n{_ds3('get_time', '{}')}{DS_END}{DS_EOS}",
         ("", "Checking.", [("get_weather", WJ), ("get_time", "{}")])),
        ("No tools needed.", ("", "No tools needed.", [])),
        (f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Pa",
         ("", "", [("get_weather", '{"city": "Pa')])),                 # cut by max_tokens
        (f"a {DS_BEGIN}{_ds3('unknown_fn', WJ)}{DS_END}",            # not allowed: content
         ("", f"a {DS_CALL}function{DS_SEP}unknown_fn\n```json\n{WJ}\n```{DS_CALL_END}", [])),
        ("<｜tool▁calls", ("", "<｜tool▁calls", [])),
    ],
    (None, "deepseek_v31"): [
        (f"{DS_BEGIN}{_ds31('get_weather', WJ)}{DS_END}{DS_EOS}", ("", "", [("get_weather", WJ)])),
        (f"Let me look.{DS_BEGIN}{_ds31('get_weather', WJ)}{_ds31('get_time', '')}{DS_END}",
         ("", "Let me look.", [("get_weather", WJ), ("get_time", "{}")])),
        (f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}  {WJ}  {DS_CALL_END}{DS_END}",
         ("", "", [("get_weather", WJ)])),
        ("Hello", ("", "Hello", [])),
        (f"Hello{DS_EOS}", ("", "Hello", [])),
    ],
    ("deepseek_r1", "deepseek_v31"): [
        (f"I need the weather.</think>{DS_BEGIN}{_ds31('get_weather', WJ)}{DS_END}",
         ("I need the weather.", "", [("get_weather", WJ)])),
    ],
    (None, "kimi_k2"): [
        (f"{KIMI[0]}{_kimi('get_weather', 0, WJ)}{KIMI[1]}", ("", "", [("get_weather", WJ)])),
        (f"I'll check both.{KIMI[0]}\n{_kimi('get_weather', 0, WJ)}\n{_kimi('get_time', 1, '{}')}\n"
         f"{KIMI[1]}<|im_end|>", ("", "I'll check both.", [("get_weather", WJ), ("get_time", "{}")])),
        ("Plain answer.<|im_end|>", ("", "Plain answer.", [])),
        (f"{KIMI[0]}{KIMI[2]}functions.get_weather:0{KIMI[3]}{{\"ci",
         ("", "", [("get_weather", '{"ci')])),
        (f"{KIMI[0]}{KIMI[2]}functions.nope:0{KIMI[3]}{{}}{KIMI[4]}{KIMI[1]}",
         ("", f"{KIMI[2]}functions.nope:0{KIMI[3]}{{}}{KIMI[4]}", [])),
    ],
    (None, "qwen3_coder"): [
        (QC, ("", "", [("get_weather", json.dumps({"city": "Paris", "days": 3}))])),
        (f"Sure, checking.\n{QC}\n{QC}", ("", "Sure, checking.", [
            ("get_weather", json.dumps({"city": "Paris", "days": 3}))] * 2)),
        ("<tool_call>\n<function=get_weather>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
         "<parameter=metric>\ntrue\n</parameter>\n<parameter=note>\nline 1\nline 2\n</parameter>\n"
         "</function>\n</tool_call>",
         ("", "", [("get_weather", json.dumps({"tags": ["a", "b"], "metric": True,
                                                "note": "line 1\nline 2"}))])),
        ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
         ("", "", [("get_weather", "{}")])),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",       # cut off
         ("", "", [("get_weather", '{"city": "Par"}')])),
        ("<tool_call>\n<function=nope>\n</function>\n</tool_call>",
         ("", "<tool_call>\n<function=nope>\n</function>\n</tool_call>", [])),
        ('<tool_call>{"name": "get_weather"}</tool_call>',
         ("", '<tool_call>{"name": "get_weather"}</tool_call>', [])),
        ("x < y, no calls", ("", "x < y, no calls", [])),
        ("Calling.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\nDone.",
         ("", "Calling.\nDone.", [("get_weather", '{"city": "Paris"}')])),           # no <tool_call>
        ("see <function=nope> and <function=", ("", "see <function=nope> and <function=", [])),
    ],
    ("seed_oss", "seed_oss"): [
        (f"<seed:think>The user asks for the weather.</seed:think>{SEED}",
         ("The user asks for the weather.", "", [("get_weather", json.dumps({"city": "Paris", "days": 3}))])),
        ("<seed:think>short</seed:think>It is sunny.", ("short", "It is sunny.", [])),
        ("still thinking", ("still thinking", "", [])),
    ],
    (None, "seed_oss"): [
        (f"Checking.\n{SEED}<seed:eos>", ("", "Checking.", [("get_weather", json.dumps({"city": "Paris", "days": 3}))])),
        ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>São Paulo \"SP\"</parameter>\n"
         "</function>\n</seed:tool_call>",
         ("", "", [("get_weather", json.dumps({"city": "São Paulo \"SP\""}, ensure_ascii=False))])),
    ],
    ("seed_oss", None): [
        ("<seed:think>a<seed:cot_budget_reflect>used 10</seed:cot_budget_reflect></seed:think>b",
         ("a<seed:cot_budget_reflect>used 10</seed:cot_budget_reflect>", "b", [])),
    ],
    (None, "mistral"): [
        (f"[TOOL_CALLS]get_weather[ARGS]{WJ}</s>", ("", "", [("get_weather", WJ)])),
        (f"Let me check.[TOOL_CALLS]get_weather[ARGS]{WJ}[TOOL_CALLS]get_time[ARGS]{{}}",
         ("", "Let me check.", [("get_weather", WJ), ("get_time", "{}")])),
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WJ}}}, '
         f'{{"name": "get_time", "arguments": {{}}}}]</s>',
         ("", "", [("get_weather", WJ), ("get_time", "{}")])),
        (ARGS_FIRST, ("", "", [("get_weather", WJ)])),
        ("The answer is 4.</s>", ("", "The answer is 4.", [])),
        ("[TOOL_CALLS]not a call", ("", "[TOOL_CALLS]not a call", [])),
        (f"[TOOL_CALLS]get_weather[ARGS]{{\"city\": \"Par", ("", "", [("get_weather", '{"city": "Par')])),
    ],
    ("openai_gptoss", "openai"): [
        (H_ANALYSIS + H_CALL, ("The user wants the weather.", "", [("get_weather", WJ)])),
        (H_ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
         ("The user wants the weather.", "It is sunny.", [])),
        (H_ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>" + H_CALL,
         ("The user wants the weather.", "Checking now.", [("get_weather", WJ)])),
        (f"<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather"
         f"<|channel|>commentary json<|message|>{WJ}<|call|>", ("x", "", [("get_weather", WJ)])),
        ("<|channel|>analysis<|message|>cut off by max_tok", ("cut off by max_tok", "", [])),
        ("no harmony at all", ("", "no harmony at all", [])),
        (H_ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.nope<|message|>{}<|call|>",
         ("The user wants the weather.", "{}", [])),
    ],
    ("openai_gptoss", None): [
        (H_ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
         ("The user wants the weather.", "Hi!", [])),
    ],
    ("gpt_oss", None): [("<|channel|>final<|message|>Done.", ("", "Done.", []))],
    (None, "openai"): [(H_ANALYSIS + H_CALL, ("The user wants the weather.", "", [("get_weather", WJ)]))],
}
ALLOWED = {"get_weather", "get_time"}
CASES = [(r, t, text, want) for (r, t), rows in GOLDEN.items() for text, want in rows]


def parser(reasoning, tool):
    counter = itertools.count()
    return make_output_parser(reasoning, tool, allowed_tools=ALLOWED, tools=TOOLS,
                              id_factory=lambda: f"call_{next(counter)}")


@pytest.mark.parametrize("reasoning,tool,text,want", CASES)
def test_golden_output_parses_to_the_published_meaning(reasoning, tool, text, want):
    out = parser(reasoning, tool).parse(text)
    assert (out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls]) == want
    for call in out.tool_calls:
        assert call.id
    if want[2] and not text.endswith(("Pa", "ci", "Par")):    # complete calls: arguments are JSON
        assert all(isinstance(json.loads(c.arguments), dict) for c in out.tool_calls)


def test_model_ids_are_kept_where_the_format_carries_them():
    kimi = parser(None, "kimi_k2").parse(GOLDEN[(None, "kimi_k2")][1][0]).tool_calls
    assert [c.id for c in kimi] == ["functions.get_weather:0", "functions.get_time:1"]
    mistral = make_output_parser(None, "mistral").parse(
        f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{WJ}[TOOL_CALLS]get_time[ARGS]{{}}").tool_calls
    assert mistral[0].id == "a1B2c3D4e"
    assert len(mistral[1].id) == 9 and mistral[1].id.isalnum()   # Mistral's templates require 9


@pytest.mark.parametrize("reasoning,tool,text,want", [
    c for c in CASES if c[2] != ARGS_FIRST and any(len(args) > 2 for _, args in c[3][2])])
def test_arguments_stream_in_several_fragments_as_generated(reasoning, tool, text, want):
    p = parser(reasoning, tool)
    fragments: dict[int, list[str]] = {}
    for ch in text:                     # one character per delta, as slow as a stream gets
        for tc in p.feed(ch).tool_calls:
            fragments.setdefault(tc.index, []).append(tc.arguments)
    for tc in p.finish().tool_calls:
        fragments.setdefault(tc.index, []).append(tc.arguments)
    assert ["".join(f) for _, f in sorted(fragments.items())] == [args for _, args in want[2]]
    longest = max(want[2], key=lambda c: len(c[1]))
    i = want[2].index(longest)
    assert len([f for f in fragments[i] if f]) > 1, "arguments must not arrive in one piece"


def test_special_token_formats_ask_to_keep_special_tokens():
    assert needs_special_tokens(None, "mistral") and needs_special_tokens(None, "kimi_k2")
    assert needs_special_tokens(None, "deepseek_v31") and needs_special_tokens(None, "seed_oss")
    assert needs_special_tokens("openai_gptoss", None) and needs_special_tokens(None, "openai")
    assert not needs_special_tokens("qwen3", "hermes") and not needs_special_tokens(None, "qwen3_coder")


@pytest.mark.parametrize("tool,text", [
    ("llama3_json", '{"answer": "' + "x" * 20_000 + '"}'),          # JSON that is not a call
    ("mistral", '[TOOL_CALLS][{"arguments": {"a": "' + "x" * 20_000 + '"}, "name": "get_time"}]'),
    ("hermes", "<tool_call>" + "x" * 20_000 + "</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n" + "x" * 20_000 + "</tool_call>"),
])
def test_a_long_undecided_output_is_read_in_linear_time(tool, text):
    # One character per delta: re-reading the held text on every delta would take minutes.
    import time
    p, t0 = parser(None, tool), time.perf_counter()
    for ch in text:
        p.feed(ch)
    p.finish()
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("raw,kind,value", [
    ("3", "integer", 3), (" 3\n", "integer", 3), ("3.5", "integer", "3.5"), ("2.5", "number", 2.5),
    ("2", "number", 2), ("nan", "number", "nan"), ("True", "boolean", True), ("yes", "boolean", "yes"),
    ("null", "integer", None), ("null", "string", "null"), ('{"a": 1}', "object", {"a": 1}),
    ("[1]", "object", "[1]"), ("007", "string", "007"), ("7", None, 7), ("Paris", None, "Paris"),
    ('"quoted"', None, '"quoted"'),
])
def test_xml_parameter_values_are_typed_by_the_schema(raw, kind, value):
    from services.gateway.parsers.xml_calls import typed_value
    assert typed_value(raw, kind) == value and type(typed_value(raw, kind)) is type(value)
