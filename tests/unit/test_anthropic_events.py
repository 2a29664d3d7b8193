"""The Messages API's streamed events (services/gateway/anthropic/events.py): for real model
outputs through the real output parsers, split at every boundary, the official anthropic
client's own accumulator turns our events into exactly the message the whole path returns;
events come in Anthropic's order; errors use Anthropic's error shape."""
from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from services.gateway.anthropic.convert import new_tool_use_id
from services.gateway.anthropic.errors import error_body, error_event
from services.gateway.anthropic.events import MessageBuilder, usage
from services.gateway.clients.request_handle import Delta
from services.gateway.errors import ApiError, invalid
from services.gateway.parsers import make_output_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
OUTPUTS = {   # (reasoning parser, tool parser, thinking asked for) -> outputs
    (None, None, False): ["Hello there, world.", "", "tokens <b>"],
    ("qwen3", None, True): ["<think>\nLet me think.\n</think>\n\nParis.", "No thinking here.",
                            "<think>cut off by max_tokens"],
    ("qwen3", None, False): ["<think>hidden</think>Shown."],
    (None, "hermes", False): [CALL, f"Let me check.\n{CALL}", f"{CALL}\n{CALL2}\n",
                              "<tool_call>{broken</tool_call> text"],
    ("qwen3", "hermes", True): [f"<think>need weather</think>{CALL}"],
}
CASES = [(r, t, th, out) for (r, t, th), outs in OUTPUTS.items() for out in outs]


class Usage:
    num_prompt_tokens, num_completion_tokens, num_cached_tokens = 12, 7, 4


def _ids():
    n = iter(range(100))
    return lambda: f"toolu_{next(n):024d}"


def _builder(reasoning, tools, thinking, omit=False) -> MessageBuilder:
    return MessageBuilder("msg_1", "m", make_output_parser(reasoning, tools, id_factory=_ids()),
                          thinking, omit)


def _events(text: str) -> list[dict]:
    """Parse SSE text, checking that every event's name is its data's type."""
    out = []
    for chunk in filter(None, text.split("\n\n")):
        name, data = chunk.split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert name == f"event: {obj['type']}"
        out.append(obj)
    return out


def _stream(builder: MessageBuilder, pieces: list[str], finish: str, stop=None) -> list[dict]:
    text = "".join(builder.opening(usage(Usage)))
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        text += "".join(builder.stream(Delta(piece, [1], finish if last else None,
                                             stop if last else None)))
    return _events(text + "".join(builder.closing(usage(Usage))))


def _whole(builder: MessageBuilder, text: str, finish: str, stop=None) -> dict:
    builder.add(Delta(text, [1], finish, stop))
    return builder.message(usage(Usage))


def _accumulate(events: list[dict]) -> dict:
    snapshot, bufs = None, {}
    for e in events:
        if e["type"] != "ping":
            snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot.model_dump(exclude_none=True)


def _comparable(message: dict) -> dict:
    return {**message, "content": [{k: v for k, v in b.items() if v is not None}
                                   for b in message["content"]]}


@pytest.mark.parametrize("reasoning, tools, thinking, output", CASES)
def test_streamed_events_accumulate_to_the_whole_message_at_every_split(reasoning, tools,
                                                                        thinking, output):
    whole = _whole(_builder(reasoning, tools, thinking), output, "stop")
    for cut in range(len(output) + 1):
        pieces = [output[:cut], output[cut:], ""]
        events = _stream(_builder(reasoning, tools, thinking), pieces, "stop")
        streamed = _accumulate(events)
        assert _comparable(streamed)["content"] == _comparable(whole)["content"], cut
        assert streamed["stop_reason"] == whole["stop_reason"]


def test_events_come_in_anthropic_order_with_indexes_and_usage():
    output = f"<think>plan</think>Checking.{CALL}"
    events = _stream(_builder("qwen3", "hermes", True), [output[:9], output[9:30], output[30:]],
                     "stop")
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"] == "msg_1"
    assert start["usage"] == {"input_tokens": 8, "output_tokens": 0,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}
    blocks = [e for e in events if e["type"].startswith("content_block")]
    opened = [e["content_block"]["type"] for e in blocks if e["type"] == "content_block_start"]
    assert opened == ["thinking", "text", "tool_use"]
    # Each block: start, deltas, stop, all with its index, indexes 0, 1, 2 in turn.
    index = -1
    for e in blocks:
        if e["type"] == "content_block_start":
            index += 1
        assert e["index"] == index
    deltas = {e["delta"]["type"] for e in blocks if e["type"] == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"}
    final = events[-2]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 7


@pytest.mark.parametrize("finish, stop, expected", [
    ("length", None, ("max_tokens", None)),
    ("stop", "STOP", ("stop_sequence", "STOP")),
    ("stop", None, ("end_turn", None)),
    ("stop", 7, ("end_turn", None)),        # a stop token id is not a stop sequence
])
def test_stop_reasons_whole_and_streamed(finish, stop, expected):
    whole = _whole(_builder(None, None, False), "text", finish, stop)
    assert (whole["stop_reason"], whole["stop_sequence"]) == expected
    delta = _stream(_builder(None, None, False), ["te", "xt"], finish, stop)[-2]["delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == expected


def test_thinking_is_dropped_unless_asked_and_emptied_when_omitted():
    output = "<think>secret</think>Answer."
    assert [b["type"] for b in _whole(_builder("qwen3", None, False), output, "stop")["content"]] \
        == ["text"]
    omitted = _whole(_builder("qwen3", None, True, omit=True), output, "stop")["content"]
    assert omitted[0] == {"type": "thinking", "thinking": "", "signature": ""}
    events = _stream(_builder("qwen3", None, True, omit=True), [output], "stop")
    assert "secret" not in json.dumps(events)


def test_a_tool_call_cut_by_max_tokens_has_an_empty_input_and_stop_reason_max_tokens():
    # The tool parser emits what it has of a call cut before its end.
    builder = MessageBuilder("msg_1", "m", make_output_parser(None, "hermes",
                                                              id_factory=new_tool_use_id), False)
    whole = _whole(builder, '<tool_call>{"name": "f", "arguments": {"a": "unfini', "length")
    assert whole["stop_reason"] == "max_tokens"
    for block in whole["content"]:
        assert block["type"] in ("text", "tool_use")
        if block["type"] == "tool_use":
            assert block["input"] == {} and block["id"].startswith("toolu_")


def test_errors_have_anthropic_shape_with_the_field_leading_the_message():
    body = error_body(invalid("at most 4 stop strings are allowed", "stop"), "req-1")
    assert body == {"type": "error", "request_id": "req-1", "error": {
        "type": "invalid_request_error",
        "message": "stop_sequences: at most 4 stop strings are allowed"}}
    named = error_body(invalid("max_tokens: must be >= 1", "max_tokens"))
    assert named["error"]["message"] == "max_tokens: must be >= 1" and "request_id" not in named
    kinds = {"unauthenticated": "authentication_error", "not_found": "not_found_error",
             "too_large": "request_too_large", "resource_exhausted": "rate_limit_error",
             "unavailable": "overloaded_error", "internal": "api_error",
             "deadline": "timeout_error", "permission_denied": "permission_error"}
    for kind, expected in kinds.items():
        assert error_body(ApiError(kind, "x"))["error"]["type"] == expected
    [event] = _events(error_event(ApiError("unavailable", "engine gone"), "req-2"))
    assert event == {"type": "error", "request_id": "req-2",
                     "error": {"type": "overloaded_error", "message": "engine gone"}}
