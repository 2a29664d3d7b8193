"""Conformance suite of the output parsers: for every parser, golden model outputs streamed
in deltas split at every boundary give exactly the non-streamed parse; logprobs survive;
malformed tool JSON becomes content, never an exception."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from services.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, make_output_parser
from tests.unit import test_parsers_golden

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
L3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'

GOLDEN = {
    ("deepseek_r1", None): [
        "I should add.</think>The answer is 4.",
        "<think>\nplan</think>\n\nDone",
        "thinking that never ends",
        "", "   ", "<thi", "a</think", "x</think></think>y",
    ],
    ("qwen3", None): [
        "<think>\nLet me think.\n</think>\n\nParis.",
        "  <think>a</think>b", "No thinking here.", "<think>cut off by max_tokens",
        "<think></think>", "<thinking>not a tag</thinking>", "", "<", "a <think>b</think>",
    ],
    (None, "hermes"): [
        CALL, f"Let me check.\n{CALL}", f"{CALL}\n{CALL2}\n", f"{CALL}\nAnd some text after.  ",
        "plain text, no calls", "<tool_call>{not json}</tool_call> then text",
        '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # EOS before </tool_call>
        "<tool_call>{broken", "text <tool_ca", "a < b and <tool> is not a call", "  \n ",
        f"x <tool_call>bad</tool_call> {CALL} y", "<tool_call></tool_call>",
        '<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>',
    ],
    (None, "llama3_json"): [
        L3, f"  {L3}  ", f"<|python_tag|>{L3}", f"{L3}; {L3}", "Just text.", '{"not": "a call"}',
        "{broken", f"{L3} trailing", "", "<|pyth", "<|python_tag|>plain",
        '{"name": "f", "arguments": {"x": [1, {"y": "}"}]}}',
    ],
    ("qwen3", "hermes"): [
        f"<think>I need the weather.</think>\n\n{CALL}",
        f"<think>{CALL} inside thinking is reasoning</think>ok",
        "<think>unfinished", f"no think {CALL}",
    ],
    ("deepseek_r1", "llama3_json"): [f"hmm</think>{L3}", "hmm</think>answer", "all reasoning"],
}
# The newer formats' golden outputs (with their expected parses) live in test_parsers_golden.
for key, rows in test_parsers_golden.GOLDEN.items():
    GOLDEN.setdefault(key, []).extend(text for text, _ in rows)
CASES = [(r, t, text) for (r, t), texts in GOLDEN.items() for text in texts]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parser(reasoning, tool, allowed=None):
    if allowed is None and (reasoning, tool) in test_parsers_golden.GOLDEN:
        allowed = test_parsers_golden.ALLOWED
    return make_output_parser(reasoning, tool, allowed_tools=allowed, id_factory=_ids(),
                              tools=test_parsers_golden.TOOLS)


def _whole(reasoning, tool, text, allowed=None):
    out = _parser(reasoning, tool, allowed).parse(text)
    return out.reasoning, out.content, [(c.id, c.name, c.arguments) for c in out.tool_calls]


def _streamed(reasoning, tool, pieces, allowed=None):
    parser = _parser(reasoning, tool, allowed)
    deltas = [parser.feed(p, [i]) for i, p in enumerate(pieces)] + [parser.finish()]
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.id and tc.name and tc.arguments == "", "a call must open with id and name"
                calls[tc.index] = [tc.id, tc.name, ""]
            else:
                assert tc.id is None and tc.name is None
                calls[tc.index][2] += tc.arguments
    assert sorted(calls) == list(range(len(calls))), "tool call indices are 0..n-1"
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert logprobs == list(range(len(pieces))), "every delta's logprobs come out, in order"
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [tuple(calls[i]) for i in sorted(calls)])


def _splits(text):
    yield [text]
    yield list(text)                                        # one char per delta
    for i in range(len(text) + 1):                          # every two-way boundary
        yield [text[:i], text[i:]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_every_registered_parser_has_golden_outputs():
    covered = {r for r, _ in GOLDEN if r} | {t for _, t in GOLDEN if t}
    assert covered == set(REASONING_PARSERS) | set(TOOL_PARSERS)


@pytest.mark.parametrize("reasoning,tool,text", CASES)
def test_streamed_parse_equals_whole_parse_at_every_split(reasoning, tool, text):
    expected = _whole(reasoning, tool, text)
    for pieces in _splits(text):
        assert _streamed(reasoning, tool, pieces) == expected, pieces


def test_think_parsers_split_reasoning_from_content():
    assert _whole("qwen3", None, "<think>\nLet me think.\n</think>\n\nParis.") == \
        ("\nLet me think.\n", "\n\nParis.", [])
    assert _whole("qwen3", None, "No thinking here.") == ("", "No thinking here.", [])
    assert _whole("deepseek_r1", None, "I should add.</think>4") == ("I should add.", "4", [])
    assert _whole("deepseek_r1", None, "still thinking") == ("still thinking", "", [])


def test_hermes_extracts_calls_and_keeps_surrounding_text():
    r, content, calls = _whole(None, "hermes", f"Let me check.\n{CALL}\n{CALL2}\n")
    assert content == "Let me check."
    assert calls == [("call_0", "get_weather", json.dumps({"city": "Paris", "unit": "c"})),
                     ("call_1", "get_time", json.dumps({"tz": "UTC"}))]


@pytest.mark.parametrize("bad", ["<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>",
                                 '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{broken",
                                 '<tool_call>{"name": "f", "arguments": 3}</tool_call>'])
def test_malformed_tool_json_becomes_content(bad):
    assert _whole(None, "hermes", bad) == ("", bad, [])
    assert _streamed(None, "hermes", list(bad)) == ("", bad, [])


def test_llama3_json_calls_and_non_calls():
    assert _whole(None, "llama3_json", f"{L3}; {L3}")[2] == [
        ("call_0", "get_weather", '{"city": "Paris"}'), ("call_1", "get_weather", '{"city": "Paris"}')]
    assert _whole(None, "llama3_json", '{"not": "a call"}') == ("", '{"not": "a call"}', [])


def test_a_named_tool_choice_leaves_other_calls_as_content():
    allowed = {"get_time"}
    r, content, calls = _whole(None, "hermes", f"{CALL}{CALL2}", allowed)
    assert [c[1] for c in calls] == ["get_time"] and content == CALL
    assert _streamed(None, "hermes", list(CALL + CALL2), allowed) == (r, content, calls)
