"""gpt-oss output in OpenAI's harmony format, parsed from its text (docs/parsers.md says why
not with the openai-harmony package).

The output is a run of messages, each a header and a body (the first one's `<|start|>assistant`
is the end of the prompt):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The recipient (`to=...`) may also stand in the role part: `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`. A body ends at `<|end|>`, `<|call|>`, `<|return|>` or
the end of the output.

- channel `analysis` -> reasoning (with either of the two harmony parsers configured);
- a message to `functions.NAME` -> a tool call whose arguments are the body, streamed, when
  tool calls are parsed and NAME is allowed; otherwise its body is content;
- `final`, `commentary` without a recipient (a preamble) and any other message -> content.
Output that does not start with a harmony header is content, all of it."""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from services.gateway.parsers.base import OutputParser, ParsedDelta, ParsedOutput, held_prefix_len
from services.gateway.parsers.streaming import StreamingToolParser

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HEADS = (START, CHANNEL)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def _held(buf: str, markers: Sequence[str]) -> int:
    return max(held_prefix_len(buf, m) for m in markers)


class HarmonyReader(StreamingToolParser):
    """Content and tool calls like any tool parser, plus the analysis channel as reasoning."""
    needs_special_tokens = True

    def __init__(self, *args, parse_calls: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parse_calls = parse_calls
        self.state = "start"      # start -> header -> body -> between -> header ... | plain
        self.route = "content"    # where the current body goes: reasoning | content | call
        self._reasoning: list[str] = []
        self._arg_ws = ""

    def take_reasoning(self) -> str:
        out, self._reasoning = "".join(self._reasoning), []
        return out

    def advance(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass
        if final and self.state == "body" and self.route == "call" and self._call_open:
            self.close_call()

    def _start(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head and not final:
            return False
        if any(head.startswith(h) for h in _HEADS):
            self.take(len(self.buf) - len(head))
            self.state = "header"
        elif any(h.startswith(head) for h in _HEADS) and head and not final:
            return False
        else:
            self.state = "plain"
        return True

    def _plain(self, final: bool) -> bool:
        self.emit_content(self.take(len(self.buf)))
        return False

    def _header(self, final: bool) -> bool:
        end, _ = self.find(MESSAGE)
        if end < 0:
            if final:                    # a header cut off: nothing to show
                self.take(len(self.buf))
            return False
        header = self.take(end)
        self.take(len(MESSAGE))
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1).removeprefix("functions.") if recipient else ""
        if channel and channel.group(1) == "analysis" and not recipient:
            self.route = "reasoning"
        elif recipient and recipient.group(1).startswith("functions.") and self.parse_calls \
                and self.allowed(name):
            self.route = "call"
            self.open_call(name)
            self._arg_ws = ""
        else:
            self.route = "content"
        self.state = "body"
        return True

    def _body(self, final: bool) -> bool:
        hits = [(self.buf.find(m), m) for m in BODY_ENDS if m in self.buf]
        end, marker = min(hits) if hits else (-1, "")
        keep = 0 if final or end >= 0 else _held(self.buf, BODY_ENDS)
        text = self.take(end if end >= 0 else len(self.buf) - keep)
        if self.route == "reasoning":
            if text:
                self._reasoning.append(text)
        elif self.route == "call":
            text = self._arg_ws + text
            body = text.rstrip()
            self._arg_ws = text[len(body):]
            self.emit_args(body.lstrip() if self._args_blank else body)
        else:
            self.emit_content(text)
        if end < 0:
            return False
        self.take(len(marker))
        if self.route == "call":
            self.close_call()
        self.state = "between"
        return True

    def _between(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith(START):
            self.take(len(self.buf) - len(head) + len(START))
            self.state = "header"
            return True
        if head.startswith(CHANNEL):
            self.take(len(self.buf) - len(head))
            self.state = "header"
            return True
        if not final and (not head or any(h.startswith(head) for h in _HEADS)):
            return False
        self.state = "plain"      # text after a message that starts no new one
        return True


class HarmonyOutputParser(OutputParser):
    """Both halves of OutputParser in one reader: harmony's channels decide reasoning, content
    and calls together."""

    def __init__(self, reader: HarmonyReader) -> None:
        super().__init__(None, None)
        self.reader = reader

    @property
    def num_tool_calls(self) -> int:
        return self.reader.num_calls

    def _delta(self, content_calls, logprobs: Sequence[Any]) -> ParsedDelta:
        content, calls = content_calls
        return ParsedDelta(reasoning=self.reader.take_reasoning(), content=content, tool_calls=calls,
                           logprobs=list(logprobs))

    def feed(self, text: str, logprobs: Sequence[Any] = ()) -> ParsedDelta:
        return self._delta(self.reader.feed(text), logprobs)

    def finish(self, logprobs: Sequence[Any] = ()) -> ParsedDelta:
        return self._delta(self.reader.finish(), logprobs)

    def parse(self, text: str) -> ParsedOutput:
        content, calls = self.reader.parse(text)
        return ParsedOutput(self.reader.take_reasoning(), content, calls)
