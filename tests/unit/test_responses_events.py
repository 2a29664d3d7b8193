"""Responses output items and stream events from parsed output: the order the openai client's
stream accumulator needs, sequence numbers, and the same output streamed or whole."""
import itertools
import json

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from openai._models import construct_type_unchecked

from services.gateway.openai.responses_events import (ResponseBuilder, history_of, parse_in_order,
                                                      usage_of)
from services.gateway.parsers import ParsedDelta, ToolCallDelta, make_output_parser

BASE = {"id": "resp_1", "created_at": 1, "model": "m", "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": True}


def ids():
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def run(pieces, status="completed"):
    b = ResponseBuilder(dict(BASE), new_id=ids())
    events = b.start()
    for piece in pieces:
        events += b.feed(piece)
    events += b.finish(status, usage_of(5, 7, 2, 3))
    return b, events


def sdk_final(events):
    """What the openai client's stream helper assembles from these events."""
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for e in json.loads(json.dumps(events)):
        state.handle_event(construct_type_unchecked(value=e, type_=ResponseStreamEvent))
    return state._completed_response


def test_text_deltas_assemble_in_one_message_and_the_client_accepts_the_stream():
    b, events = run([ParsedDelta(content="Hel"), ParsedDelta(content="lo")])
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    [item] = b.output
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello"
    assert item["status"] == "completed" and item["id"].startswith("msg_")
    final = sdk_final(events)
    assert final.output_text == "Hello" and final.usage.output_tokens_details.reasoning_tokens == 3
    assert final.usage.input_tokens_details.cached_tokens == 2 and final.usage.total_tokens == 12


def test_reasoning_then_text_then_calls_are_separate_items():
    b, events = run([ParsedDelta(reasoning="think"), ParsedDelta(reasoning=" more", content="Ok"),
                     ParsedDelta(content="\n", tool_calls=[
                         ToolCallDelta(0, id="call_a", name="f"), ToolCallDelta(0, arguments='{"x"'),
                         ToolCallDelta(0, arguments=': 1}')]),
                     ParsedDelta(content="\n", tool_calls=[ToolCallDelta(1, id="call_b", name="g",
                                                                       arguments="{}")])])
    assert [i["type"] for i in b.output] == ["reasoning", "message", "function_call", "function_call"]
    assert b.reasoning_text() == "think more"
    assert b.output[1]["content"][0]["text"] == "Ok\n"   # text after an open message stays
    call = b.output[2]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == \
        ("call_a", "f", '{"x": 1}', "completed")
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
              and e["item_id"] == call["id"]]
    assert deltas == ['{"x"', ': 1}']
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == ['{"x": 1}', "{}"]
    assert "response.reasoning_text.delta" in [e["type"] for e in events]
    final = sdk_final(events)
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert json.loads(final.output[2].arguments) == {"x": 1}
    assert history_of(b.output) == [{"role": "assistant", "content": "Ok\n", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]


def test_whitespace_between_calls_makes_no_message_but_alone_it_is_kept():
    b, _ = run([ParsedDelta(tool_calls=[ToolCallDelta(0, id="c", name="f", arguments="{}")]),
                ParsedDelta(content="\n"),
                ParsedDelta(tool_calls=[ToolCallDelta(1, id="d", name="f", arguments="{}")])])
    assert [i["type"] for i in b.output] == ["function_call", "function_call"]
    b, _ = run([ParsedDelta(content="  ")])
    assert b.output[0]["content"][0]["text"] == "  "


def test_a_cut_response_is_incomplete_with_its_reason_and_the_open_item_incomplete():
    b, events = run([ParsedDelta(content="partial")], status="incomplete")
    assert events[-1]["type"] == "response.incomplete"
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert b.output[0]["status"] == "incomplete"


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_failed_and_cancelled_streams_end_with_response_failed(status):
    b, events = run([ParsedDelta(content="x")], status=status)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == status
    with pytest.raises(ValueError):
        b.finish("in_progress")


def test_events_are_snapshots_not_later_states():
    b = ResponseBuilder(dict(BASE), new_id=ids())
    created = b.start()[0]
    added = b.feed(ParsedDelta(content="a"))
    b.feed(ParsedDelta(content="b"))
    assert created["response"]["output"] == [] and created["response"]["status"] == "in_progress"
    part = [e for e in added if e["type"] == "response.content_part.added"][0]["part"]
    assert part["text"] == ""


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("reasoning, text, expected", [
    (None, "Sure." + CALL + "Done.", [("message", "Sure."), ("function_call", '{"x": 1}'),
                                      ("message", "Done.")]),
    ("deepseek_r1", "hmm</think>Sure." + CALL + "\n" + CALL,
     [("reasoning", "hmm"), ("message", "Sure."), ("function_call", '{"x": 1}'),
      ("function_call", '{"x": 1}')]),
])
def test_real_parsers_split_anywhere_give_the_items_in_text_order(reasoning, text, expected):
    for cut in range(1, len(text) + 1):
        parser = make_output_parser(reasoning, "hermes", allowed_tools={"f"})
        b = ResponseBuilder(dict(BASE), new_id=ids())
        b.start()
        for chunk, last in ((text[:cut], False), (text[cut:], True)):
            for piece in parse_in_order(parser, chunk, last):
                b.feed(piece)
        b.finish("completed", usage_of(1, 1))
        got = [(i["type"], i["arguments"] if i["type"] == "function_call"
                else i["content"][0]["text"]) for i in b.output]
        assert got == expected, cut


def test_the_open_call_takes_its_arguments_before_text_of_the_same_piece():
    b = ResponseBuilder(dict(BASE), new_id=ids())
    b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, id="c", name="f", arguments='{"x": ')]))
    b.feed(ParsedDelta(content="after", tool_calls=[ToolCallDelta(0, arguments="1}")]))
    assert [(i["type"], i.get("arguments")) for i in b.output] == [
        ("function_call", '{"x": 1}'), ("message", None)]


def test_a_steps_logprobs_go_to_its_text_delta_and_the_message():
    b = ResponseBuilder(dict(BASE), new_id=ids())
    b.start()
    lp = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}]
    events = b.feed(ParsedDelta(content="Hi"))
    b.add_logprobs(lp, events)
    assert [e for e in events if e["type"] == "response.output_text.delta"][0]["logprobs"] == lp
    b.add_logprobs(lp, b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, id="c", name="f")])))
    done = [e for e in b.finish("completed") if e["type"] == "response.output_text.done"]
    assert b.output[0]["content"][0]["logprobs"] == lp   # the call's tokens have none
    assert not done   # the message was closed by the call
