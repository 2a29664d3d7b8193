"""The base of every tool-call parser: a state machine over the text, fed piece by piece,
that streams each call as it is generated (vLLM's shape: one fragment with the id and name,
then fragments of `function.arguments` text, never the whole call at its end).

A subclass implements `advance(final)`: consume what it can of `self.buf` (the text not yet
decided) through the emit helpers, keep the undecided rest in `self.buf`. `parse(text)` runs the
same machine over the whole text, so a whole response and the concatenation of a stream agree
by construction; the conformance suite checks that no split of the text changes the result.

Decisions are taken on prefixes only: once a call's header (its name) has been read, the call is
committed and its arguments stream; what came before that is held or emitted as content.
Whitespace that only separates calls (or trails the output when there were calls) is dropped,
as OpenAI does."""
from __future__ import annotations

import json

from services.gateway.parsers.base import ToolCall, ToolCallDelta, ToolParser


# The end-of-sequence texts of the chat models these parsers serve.
END_OF_SEQUENCE = ("</s>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<｜end▁of▁sentence｜>",
                   "<seed:eos>")


class StreamingToolParser(ToolParser):
    # With special tokens kept in the text, the end-of-sequence token's text may close the
    # output: held back like trailing whitespace, and dropped if nothing follows it.
    end_strings: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buf = ""                            # text not decided yet
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._ws = ""                            # whitespace held until content follows
        self._call_open = False
        self._args_blank = True                  # the open call streamed no arguments yet
        self._searched: tuple[tuple[str, ...], int] = ((), 0)   # see find()

    # -- the ToolParser interface ---------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        self.advance(final=False)
        return self._drain()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self.advance(final=True)
        if self._call_open:        # the output ended inside a call (max_tokens or EOS)
            self.close_call()
        if not self.num_calls:
            tail = self._ws
            for end in self.end_strings:
                if tail.rstrip().endswith(end):
                    tail = tail.rstrip()[:-len(end)]
                    break
            self._content.append(tail)
        self._ws = ""
        return self._drain()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, deltas = self.feed(text)
        more, more_deltas = self.finish()
        calls: dict[int, list[str]] = {}
        for d in deltas + more_deltas:
            if d.name is not None:
                calls[d.index] = [d.id or "", d.name, ""]
            calls[d.index][2] += d.arguments
        return content + more, [ToolCall(*calls[i]) for i in sorted(calls)]

    # -- for subclasses -------------------------------------------------------------------
    def advance(self, final: bool) -> None:
        raise NotImplementedError

    def allowed(self, name: str) -> bool:
        return bool(name) and (self.allowed_names is None or name in self.allowed_names)

    def emit_content(self, text: str) -> None:
        """`text` is content; its trailing whitespace is held back (dropped if a call follows)."""
        if not text:
            return
        text = self._ws + text
        body = text.rstrip()
        for end in self.end_strings:
            keep = next((n for n in range(min(len(end), len(body)), 0, -1)
                         if end.startswith(body[-n:])), 0)
            if keep:
                body = body[:-keep]
                break
        self._ws = text[len(body):]
        if body:
            self._content.append(body)

    def open_call(self, name: str, call_id: str | None = None) -> None:
        self._ws = ""
        self._deltas.append(ToolCallDelta(self.num_calls, id=call_id or self.new_id(), name=name))
        self.num_calls += 1
        self._call_open, self._args_blank = True, True

    def emit_args(self, text: str) -> None:
        if text:
            self._args_blank = self._args_blank and not text.strip()
            self._deltas.append(ToolCallDelta(self.num_calls - 1, arguments=text))

    def close_call(self) -> None:
        """The open call is complete; one that streamed no arguments gets `{}`."""
        if self._args_blank:
            self.emit_args("{}")
        self._call_open = False

    def emit_whole_call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        self.open_call(name, call_id)
        self.emit_args(arguments)
        self.close_call()

    def take(self, n: int) -> str:
        """Remove and return the first `n` characters of the undecided text."""
        head, self.buf = self.buf[:n], self.buf[n:]
        if n:
            self._searched = ((), 0)
        return head

    def find(self, *markers: str) -> tuple[int, str]:
        """(index, marker) of the first of `markers` in the undecided text, or (-1, ""). While a
        state waits for a marker and the text only grows, each call searches only the new part
        (a long wait stays linear)."""
        memo, start = self._searched
        start = start if memo == markers else 0
        hits = [(i, m) for m in markers if (i := self.buf.find(m, start)) >= 0]
        if hits:
            return min(hits)
        self._searched = (markers, max(0, len(self.buf) - max(map(len, markers)) + 1))
        return -1, ""

    # -- internals ------------------------------------------------------------------------
    def _drain(self) -> tuple[str, list[ToolCallDelta]]:
        content, self._content = "".join(self._content), []
        merged: list[ToolCallDelta] = []
        for d in self._deltas:   # one fragment per call and feed: adjacent argument text joined
            if merged and d.name is None and merged[-1].name is None and merged[-1].index == d.index:
                merged[-1] = ToolCallDelta(d.index, arguments=merged[-1].arguments + d.arguments)
            else:
                merged.append(d)
        self._deltas = []
        return content, merged


def json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
