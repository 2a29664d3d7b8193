"""XML tool calls: Qwen3-Coder (`<tool_call>`) and Seed-OSS (`<seed:tool_call>`).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The arguments are built as a JSON object, one member per parameter, streamed as each parameter
is read (a parameter whose schema type is `string` streams character by character). A value
loses one leading and one trailing newline and is typed by the tool's schema: string as is;
integer / number / boolean / object / array parsed (`null` is null), falling back to the
string when it does not parse; with no schema type, any JSON value but a string is taken as
parsed (SGLang's rule), else the string. Text between parameters is dropped; a function the
request did not allow stays in the content, verbatim."""
from __future__ import annotations

import json
import math
from typing import Any

from services.gateway.parsers.base import held_prefix_len
from services.gateway.parsers.streaming import END_OF_SEQUENCE, StreamingToolParser

FUNCTION, PARAMETER = "<function=", "<parameter="
END_FUNCTION, END_PARAMETER = "</function>", "</parameter>"
_VALUE_ENDS = (END_PARAMETER, PARAMETER, END_FUNCTION)


def _schema_type(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def typed_value(raw: str, kind: str | None) -> Any:
    """The JSON value of a parameter's text, by its schema type."""
    if kind == "string":
        return raw
    if raw.strip().lower() == "null" and kind is not None:
        return None
    try:
        if kind == "integer":
            return int(raw.strip())
        if kind == "number":
            value = float(raw.strip())
            if not math.isfinite(value):      # nan / inf are not JSON
                return raw
            return int(value) if value.is_integer() and "." not in raw and "e" not in raw.lower() else value
        if kind == "boolean":
            return {"true": True, "false": False}[raw.strip().lower()]
        value = json.loads(raw)
    except (ValueError, KeyError):
        return raw
    if kind in ("object", "array"):
        return value if isinstance(value, dict if kind == "object" else list) else raw
    return raw if isinstance(value, str) else value


def _first_end(buf: str) -> int:
    hits = [i for i in (buf.find(m) for m in _VALUE_ENDS) if i >= 0]
    return min(hits) if hits else -1


class XmlToolParser(StreamingToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BARE_FUNCTIONS = False    # also read a `<function=...>` that comes without OPEN

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"   # text -> function -> params <-> value -> after -> text
        self.function = ""
        self.param = ""
        self.members = 0      # parameters emitted for the open call
        self.value = ""       # a value read so far (not streamed)
        self.streaming = False
        self.value_started = False
        self.newline = ""     # a trailing newline held back from a streamed value
        self.wrapped = True   # the open call came inside OPEN ... CLOSE

    def advance(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass
        if final and self._call_open:      # cut off inside the call: close what was opened
            if self.state == "value":
                self._end_value()
            self._end_function()

    # -- states: True to go on, False to wait for more text -----------------------------------
    def _text(self, final: bool) -> bool:
        markers = (self.OPEN, FUNCTION) if self.BARE_FUNCTIONS else (self.OPEN,)
        hits = [(i, m) for m in markers if (i := self.buf.find(m)) >= 0]
        if not hits:
            keep = 0 if final else max(held_prefix_len(self.buf, m) for m in markers)
            self.emit_content(self.take(len(self.buf) - keep))
            return False
        start, marker = min(hits)
        self.emit_content(self.take(start))
        self.wrapped = marker == self.OPEN
        if self.wrapped:
            self.take(len(self.OPEN))
        self.state = "function"
        return True

    def _reject(self) -> bool:
        if self.wrapped:
            self.state = "rejected"
        else:                      # a bare `<function=` that is no call: it was content
            self.emit_content(self.take(len(FUNCTION)))
            self.state = "text"
        return True

    def _function(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head.startswith(FUNCTION):
            if FUNCTION.startswith(head) and not final:
                return False
            return self._reject()
        lead = len(self.buf) - len(head)
        end, _ = self.find(">")
        if end < 0:
            return self._reject() if final else False
        name = self.buf[lead + len(FUNCTION):end].strip()
        if not self.allowed(name):
            return self._reject()
        self.take(end + 1)
        self.open_call(name)
        self.function, self.members, self.state = name, 0, "params"
        return True

    def _params(self, final: bool) -> bool:
        self.take(len(self.buf) - len(self.buf.lstrip()))
        buf = self.buf
        if buf.startswith(PARAMETER):
            end, _ = self.find(">")
            if end < 0:
                return False
            self.param = buf[len(PARAMETER):end].strip()
            self.take(end + 1)
            kind = _schema_type(self.schemas.get(self.function, {}).get("properties", {}).get(self.param))
            self.streaming, self.value_started, self.value, self.newline = kind == "string", False, "", ""
            if self.streaming:
                self._member_head()
                self.emit_args('"')
            self.state = "value"
            return True
        for marker in (END_FUNCTION, self.CLOSE):
            if buf.startswith(marker):
                self._end_function()
                if marker == END_FUNCTION:
                    self.take(len(marker))
                    self.state = "after" if self.wrapped else "text"
                else:
                    self.state = "text"
                    self.take(len(marker))
                return True
        nxt = [i for i in (buf.find(m) for m in (PARAMETER, END_FUNCTION, self.CLOSE)) if i >= 0]
        if nxt:                                   # stray text between parameters: dropped
            self.take(min(nxt))
            return True
        keep = max(held_prefix_len(buf, m) for m in (PARAMETER, END_FUNCTION, self.CLOSE))
        self.take(len(buf) - keep)
        return False

    def _value(self, final: bool) -> bool:
        if not self.value_started:
            if not self.buf and not final:
                return False
            if self.buf.startswith("\n"):
                self.take(1)
            self.value_started = True
        end = _first_end(self.buf)
        if end < 0:
            keep = 0 if final else max(held_prefix_len(self.buf, m) for m in _VALUE_ENDS)
            self._add_value(self.take(len(self.buf) - keep))
            return False
        self._add_value(self.take(end))
        if self.buf.startswith(END_PARAMETER):
            self.take(len(END_PARAMETER))
        self._end_value()
        self.state = "params"
        return True

    def _after(self, final: bool) -> bool:
        end = self.buf.find(self.CLOSE)
        if end < 0:
            keep = 0 if final else held_prefix_len(self.buf, self.CLOSE)
            self.take(len(self.buf) - keep)
            return False
        self.take(end + len(self.CLOSE))
        self.state = "text"
        return True

    def _rejected(self, final: bool) -> bool:
        end, _ = self.find(self.CLOSE)
        if end < 0 and not final:
            return False
        text = self.take(len(self.buf) if end < 0 else end + len(self.CLOSE))
        self.emit_content(self.OPEN + text)
        self.state = "text"
        return end >= 0

    # -- building the arguments ---------------------------------------------------------------
    def _member_head(self) -> None:
        self.emit_args(("{" if not self.members else ", ") + json.dumps(self.param, ensure_ascii=False) + ": ")
        self.members += 1

    def _add_value(self, text: str) -> None:
        if not self.streaming:
            self.value += text
            return
        text = self.newline + text
        self.newline = "\n" if text.endswith("\n") else ""
        text = text[:-1] if self.newline else text
        self.emit_args(json.dumps(text, ensure_ascii=False)[1:-1])

    def _end_value(self) -> None:
        if self.streaming:
            self.emit_args('"')
        else:
            raw = self.value[:-1] if self.value.endswith("\n") else self.value
            kind = _schema_type(self.schemas.get(self.function, {}).get("properties", {}).get(self.param))
            self._member_head()
            self.emit_args(json.dumps(typed_value(raw, kind), ensure_ascii=False))
        self.streaming = False

    def _end_function(self) -> None:
        self.emit_args("}" if self.members else "{}")
        self.close_call()


class Qwen3CoderToolParser(XmlToolParser):
    """Qwen3-Coder sometimes leaves out `<tool_call>`: a bare `<function=NAME>` (an allowed
    NAME) is a call too, as vLLM's parser reads it."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BARE_FUNCTIONS = True


class SeedOssToolParser(XmlToolParser):
    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"
    needs_special_tokens = True    # Seed's <seed:...> markers may be special tokens
    end_strings = END_OF_SEQUENCE
