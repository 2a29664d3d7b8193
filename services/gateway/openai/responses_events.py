"""One Responses API response as it is generated: parsed output in, output items and stream
events out. Pure: no I/O, no clocks (the caller passes times and ids come from `new_id`).

The same builder serves a streamed and a whole response (the whole one drops the events), so
both give the same output items. Each parsed piece (reasoning, then content, then tool calls,
as openai/choices.py orders them for chat) continues the open output item or closes it and
opens the next:

    reasoning  -> a `reasoning` item (content: one reasoning_text part)
    content    -> a `message` item (content: one output_text part)
    tool call  -> a `function_call` item per call (arguments streamed as deltas)

Whitespace-only content is held back until text follows, so the newline between two tool calls
does not become a message of its own; a response with no other output still gets it."""
from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from services.gateway.parsers import OutputParser, ParsedDelta

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
# The last event of a response, by its final status (OpenAI has no response.cancelled event:
# a cancelled stream ends with response.failed whose response says status "cancelled").
_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed", "cancelled": "response.failed"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(input_tokens: int, output_tokens: int, cached_tokens: int = 0,
             reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


class ResponseBuilder:
    def __init__(self, response: dict[str, Any],
                 new_id: Callable[[str], str] = new_item_id) -> None:
        """`response`: the response object without its output (id, model, echoed fields)."""
        self.response = {**response, "object": "response", "status": "in_progress",
                         "output": [], "usage": None, "error": None, "incomplete_details": None}
        self.new_id = new_id
        self.sequence = 0
        self._open: dict[str, Any] | None = None   # the output item receiving text now
        self._held_space = ""                       # whitespace-only content not yet placed

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "reasoning"
                       for part in item.get("content") or ())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(item) for item in self.output]}

    # -- the lifecycle ----------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
        calls = list(parsed.tool_calls)
        # The call open when this piece began continues first: any text of this piece comes
        # after the end of that call.
        while calls and calls[0].name is None and self._open is not None \
                and self._open["type"] == "function_call":
            events += self._arguments(calls.pop(0).arguments)
        if parsed.content:
            content = self._held_space + parsed.content
            if content.strip() or (self._open is not None and self._open["type"] == "message"):
                self._held_space = ""
                events += self._text("message", content)
            else:
                self._held_space = content
        for call in calls:
            if call.name is not None:
                events += self._close("completed")
                events += self._open_item({"type": "function_call", "id": self.new_id("fc"),
                                           "call_id": call.id, "name": call.name,
                                           "arguments": "", "status": "in_progress"})
            events += self._arguments(call.arguments)
        return events

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        item = self._open
        if not text or item is None or item["type"] != "function_call":
            return []
        item["arguments"] += text
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=len(self.output) - 1, delta=text)]

    def add_logprobs(self, entries: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        """One engine step's token logprobs (openai/logprobs.chat_content entries), `events` the
        ones that step made: they go to the message open now, and to its last text delta among
        `events`. Tokens that made reasoning or tool calls (no message open) have none."""
        item = self._open
        if not entries or item is None or item["type"] != "message":
            return
        item["content"][0]["logprobs"].extend(entries)
        for event in reversed(events):
            if event["type"] == "response.output_text.delta" and event["item_id"] == item["id"]:
                event["logprobs"] = entries
                return

    def finish(self, status: str, usage: dict[str, Any] | None = None, *,
               error: dict[str, Any] | None = None, completed_at: int | None = None,
               incomplete_reason: str = "max_output_tokens") -> list[dict[str, Any]]:
        """Close the open item and end the response with `status` (one of TERMINAL)."""
        if status not in TERMINAL:
            raise ValueError(f"not a final status: {status!r}")
        events: list[dict[str, Any]] = []
        if self._held_space and not self.output:
            events += self._text("message", self._held_space)
        self._held_space = ""
        events += self._close("completed" if status == "completed" else "incomplete")
        self.response.update(status=status, usage=usage, error=error)
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": incomplete_reason}
        if status == "completed" and completed_at is not None:
            self.response["completed_at"] = completed_at
        events.append(self._event(_FINAL_EVENT[status], response=self._snapshot()))
        return events

    # -- output items -------------------------------------------------------------------------
    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        if item["type"] in ("message", "reasoning"):
            item["content"] = []
        events = [self._event("response.output_item.added", output_index=index,
                              item={**item, "content": []} if "content" in item else dict(item))]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        else:
            return events
        item["content"] = [part]
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=dict(part)))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            prefix = "msg" if kind == "message" else "rs"
            item: dict[str, Any] = {"type": kind, "id": self.new_id(prefix), "status": "in_progress"}
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            events += self._open_item(item)
        item = self._open
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(delta, item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, **extra))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      arguments=item["arguments"], **where))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", content_index=0,
                                          text=part["text"], logprobs=part["logprobs"], **where))
            else:
                events.append(self._event("response.reasoning_text.done", content_index=0,
                                          text=part["text"], **where))
            events.append(self._event("response.content_part.done", content_index=0,
                                      part=dict(part), **where))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events


# Before a tag or a JSON object starts and after one ends: what lies between two of these holds
# at most one end of a reasoning block or a tool call (hermes tags, llama3_json objects).
_ITEM_BOUNDARY = re.compile(r"(?=[<{])|(?<=[>}])")


def parse_in_order(parser: OutputParser | None, text: str, last: bool) -> list[ParsedDelta]:
    """`text` through the output parser, in pieces whose order is the text's: one ParsedDelta
    holds its reasoning, content and calls without their order (openai/choices.py needs none), so
    the text is fed up to each place where a reasoning block or a tool call may end, and what
    follows such an end comes in a later piece."""
    if parser is None:
        return [ParsedDelta(content=text)] if text else []
    pieces = [parser.feed(part) for part in _ITEM_BOUNDARY.split(text) if part]
    return pieces + [parser.finish()] if last else pieces


def history_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages a response's output adds to its conversation (for a later
    previous_response_id): the assistant turn's text and tool calls; reasoning is left out, as
    chat templates leave out earlier turns' reasoning."""
    text = "".join(item["content"][0]["text"] for item in output if item["type"] == "message")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
