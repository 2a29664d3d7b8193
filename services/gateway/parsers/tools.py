"""Tool-call parsers: Hermes / Qwen `<tool_call>{json}</tool_call>` and Llama-3 JSON.

A call is emitted when it is complete (id and name in one fragment, the arguments in the
next), never guessed from half a JSON object. A call whose JSON is malformed, lacks a
name, or names a function the request did not allow stays in the content, verbatim."""
from __future__ import annotations

import json

from services.gateway.parsers.base import ToolCall, ToolCallDelta, ToolParser, held_prefix_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    """Content is everything outside well-formed calls. Whitespace that only separates
    calls (or trails the output when there were calls) is dropped, as OpenAI does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_call = False
        self._buf = ""       # undecided text: a partial "<tool_call>" or a call's body
        self._ws = ""        # whitespace held until we know whether content follows

    def _content(self, text: str) -> str:
        """Emit `text` as content, holding its trailing whitespace back."""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return body

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, calls = "", []
        while True:
            if not self._in_call:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = held_prefix_len(self._buf, OPEN)
                    content += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, calls
                content += self._content(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(OPEN):], True
            end = self._buf.find(CLOSE)
            if end < 0:
                return content, calls
            body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(CLOSE):], False
            call = self.call_from_json(_json_or_none(body))
            if call is None:
                content += self._content(OPEN + body + CLOSE)
            else:
                self._ws = ""
                calls += self.emit_call(*call)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        buf, self._buf = self._buf, ""
        content, calls = "", []
        if self._in_call:  # the output ended inside a call (EOS instead of </tool_call>)
            self._in_call = False
            call = self.call_from_json(_json_or_none(buf))
            if call is None:
                content = self._content(OPEN + buf)
            else:
                self._ws = ""
                calls = self.emit_call(*call)
        else:
            content = self._content(buf)
        if not self.num_calls:
            content += self._ws
        self._ws = ""
        return content, calls

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        segments, calls, pos = [], [], 0
        text_start = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                break
            end = text.find(CLOSE, start + len(OPEN))
            body = text[start + len(OPEN):] if end < 0 else text[start + len(OPEN):end]
            call = self.call_from_json(_json_or_none(body))
            if end < 0 and call is None:
                break
            stop = len(text) if end < 0 else end + len(CLOSE)
            if call is not None:
                segments.append(text[text_start:start].rstrip())
                calls.append(ToolCall(self.new_id(), *call))
                text_start = stop
            pos = stop
        tail = text[text_start:]
        segments.append(tail.rstrip() if calls else tail)
        self.num_calls = len(calls)
        return "".join(segments), calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the whole output is `{"name": ..., "parameters": {...}}`
    (several separated by `;`), optionally after `<|python_tag|>`. Output that starts with
    `{` is held to the end (it is calls only if all of it parses); other output streams as
    content at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mode = "start"   # start -> json (held to the end) | text
        self._buf = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._mode = "json"
            elif PYTHON_TAG.startswith(head):
                return "", []
            else:
                self._mode = "text"
        if self._mode == "json":
            return "", []
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return buf, []
        calls = self._calls(buf)
        if calls is None:
            return buf, []
        return "", [d for name, args in calls for d in self.emit_call(name, args)]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = self._calls(text)
        if calls is None:
            return text, []
        self.num_calls = len(calls)
        return "", [ToolCall(self.new_id(), name, args) for name, args in calls]

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return None
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            call = self.call_from_json(obj)
            if call is None:
                return None
            calls.append(call)
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return calls
