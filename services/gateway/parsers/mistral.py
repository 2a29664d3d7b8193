"""Mistral tool calls after the `[TOOL_CALLS]` control token, in both of its formats:

- tokenizer v11 and later (Mistral Small 3.1+, Devstral, Magistral, Ministral 3):
  `[TOOL_CALLS]NAME[ARGS]{...}`, one `[TOOL_CALLS]` per call (v13 may put `[CALL_ID]ID`
  between the name and `[ARGS]`, and that id is the call's id);
- older ones (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo): `[TOOL_CALLS] [{"name": ...,
  "arguments": {...}}, ...]`, a JSON list (or a single object).

Arguments stream as generated. Ids are 9 letters and digits, which Mistral's templates require
of the tool_call_id they render back. The markers are control tokens: the text parsed keeps
special tokens (and drops a final `</s>`)."""
from __future__ import annotations

import random
import string

from services.gateway.parsers.base import held_prefix_len
from services.gateway.parsers.json_scan import ObjectScanner
from services.gateway.parsers.streaming import END_OF_SEQUENCE, StreamingToolParser
from services.gateway.parsers.tools import REJECT, WAIT, JsonCallReader, WholeObjectReader

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ALNUM, k=9))


class MistralToolParser(StreamingToolParser):
    needs_special_tokens = True
    end_strings = END_OF_SEQUENCE

    default_id = staticmethod(mistral_tool_call_id)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"   # text -> calls: name -> args | list -> item -> between ...
        self.reader: JsonCallReader | None = None

    def advance(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass

    def _text(self, final: bool) -> bool:
        start = self.buf.find(TOOL_CALLS)
        if start < 0:
            keep = 0 if final else held_prefix_len(self.buf, TOOL_CALLS)
            self.emit_content(self.take(len(self.buf) - keep))
            return False
        self.emit_content(self.take(start))
        self.take(len(TOOL_CALLS))
        self.state = "calls"
        return True

    def _calls(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            return False
        self.take(len(self.buf) - len(head))
        if head[0] == "[":
            self.take(1)
            self.state = "item"
        elif head[0] == "{":
            self.state = "item"
        else:
            self.state = "name"
        return True

    # -- v11+: NAME[ARGS]{...} ----------------------------------------------------------------
    def _name(self, final: bool) -> bool:
        index, marker = self.find(ARGS, TOOL_CALLS)
        end = index if marker == ARGS else -1
        again = index if marker == TOOL_CALLS else -1
        if again >= 0 and (end < 0 or again < end) or end < 0 and final:   # not a call: content
            self.emit_content(TOOL_CALLS + self.take(again if again >= 0 else len(self.buf)))
            self.state = "text"
            return True
        if end < 0:
            return False
        head = self.buf[:end]
        name, _, call_id = head.partition(CALL_ID)
        name, call_id = name.strip(), call_id.strip() or None
        if not self.allowed(name) or any(c.isspace() for c in name):
            self.emit_content(TOOL_CALLS + self.take(end + len(ARGS)))
            self.state = "text"
            return True
        self.take(end + len(ARGS))
        self.open_call(name, call_id)
        self.state, self.scanner = "args_start", ObjectScanner(depth=0)
        return True

    def _args_start(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            return False
        self.take(len(self.buf) - len(head))
        self.state = "args"
        return True

    def _args(self, final: bool) -> bool:
        end = self.scanner.scan(self.buf)
        self.emit_args(self.take(len(self.buf) if end < 0 else end))
        if end < 0:
            return False
        self.close_call()
        self.state = "text"
        return True

    # -- older: [{"name": ..., "arguments": {...}}, ...] --------------------------------------
    def _item(self, final: bool) -> bool:
        self.take(len(self.buf) - len(self.buf.lstrip()))
        if not self.buf:
            return False
        if self.buf[0] != "{":
            if self.buf[0] == "]":
                self.take(1)
            self.state = "text"
            return True
        self.reader = JsonCallReader(self, ("arguments", "parameters"))
        self.state = "item_call"
        return True

    def _item_call(self, final: bool) -> bool:
        step = self.reader.step(final)
        if step == WAIT:
            return False
        if step == REJECT:
            self.whole, self.state = WholeObjectReader(self), "item_whole"
            return True
        self.state = "between"
        return True

    def _item_whole(self, final: bool) -> bool:
        status, text = self.whole.step(final)
        if status == WAIT:
            return False
        if status == REJECT:
            self.emit_content(text)
        self.state = "between"
        return True

    def _between(self, final: bool) -> bool:
        self.take(len(self.buf) - len(self.buf.lstrip()))
        if not self.buf:
            return False
        if self.buf[0] == ",":
            self.take(1)
            self.state = "item"
        else:
            if self.buf[0] == "]":
                self.take(1)
            self.state = "text"
        return True
