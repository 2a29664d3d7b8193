"""JSON tool calls: Hermes / Qwen `<tool_call>{json}</tool_call>` and Llama-3 JSON.

A call whose head `{"name": "NAME", "arguments": {` has been read (NAME allowed) is committed
and its arguments stream as they are generated, verbatim. Any other shape (arguments first,
arguments as a string, a name the request did not allow, broken JSON) is read whole and decided
then: a well-formed call (`call_from_json`) is emitted in one piece, anything else stays in the
content verbatim."""
from __future__ import annotations

from services.gateway.parsers.base import held_prefix_len
from services.gateway.parsers.json_scan import NO, PARTIAL, Header, ObjectScanner, match_call_header
from services.gateway.parsers.streaming import StreamingToolParser, json_or_none

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
WAIT, DONE, REJECT = "wait", "done", "reject"
MAX_HEAD = 1024   # a call head not complete within this many characters is not streamed


class JsonCallReader:
    """Reads one call object at the start of `parser.buf`, streaming its arguments."""

    def __init__(self, parser: StreamingToolParser, arg_keys: tuple[str, ...]) -> None:
        self.parser, self.arg_keys = parser, arg_keys
        self.state = "head"
        self.scanner = ObjectScanner()

    def step(self, final: bool) -> str:
        """WAIT (need more text), DONE (the object was read) or REJECT (not a streamable call:
        nothing was consumed)."""
        p = self.parser
        if self.state == "head":
            head = match_call_header(p.buf[:MAX_HEAD], self.arg_keys)
            if head == PARTIAL and not final and len(p.buf) < MAX_HEAD:
                return WAIT
            if head in (PARTIAL, NO) or not p.allowed(head.name):
                return REJECT
            assert isinstance(head, Header)
            p.open_call(head.name)
            p.emit_args(p.take(head.end)[-1])   # the `{` that opens the arguments
            self.state = "args"
        if self.state == "args":
            end = self.scanner.scan(p.buf)
            p.emit_args(p.take(len(p.buf) if end < 0 else end))
            if end < 0:
                return DONE if final else WAIT
            p.close_call()
            self.state, self.scanner = "outer", ObjectScanner()
        end = self.scanner.scan(p.buf)          # the rest of the call object (its closing brace)
        p.take(len(p.buf) if end < 0 else end)
        return DONE if end >= 0 or final else WAIT


class WholeObjectReader:
    """A call that cannot stream: the JSON object at the start of `parser.buf`, read whole."""

    def __init__(self, parser: StreamingToolParser) -> None:
        self.parser = parser
        self.scanner = ObjectScanner(depth=0)
        self.scanned = 0     # characters of the buffer already scanned (it only grows meanwhile)

    def step(self, final: bool) -> tuple[str, str | None]:
        """(WAIT, None) until the object is complete, then (DONE, None) with the call emitted
        whole, or (REJECT, text) with the object's text taken out of the buffer (content)."""
        p = self.parser
        end = self.scanner.scan(p.buf[self.scanned:])
        if end < 0:
            self.scanned = len(p.buf)
            if not final:
                return WAIT, None
        text = p.take(len(p.buf) if end < 0 else self.scanned + end)
        call = p.call_from_json(json_or_none(text)) if end >= 0 else None
        if call is None:
            return REJECT, text
        p.emit_whole_call(*call)
        return DONE, None


class HermesToolParser(StreamingToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with content
    around them. Text after a streamed call's object, up to `</tool_call>`, is dropped."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"      # text -> call (streamed) -> tail -> text | text -> body -> text
        self.reader: JsonCallReader | None = None

    def advance(self, final: bool) -> None:
        while True:
            if self.state == "text":
                start = self.buf.find(OPEN)
                if start < 0:
                    keep = 0 if final else held_prefix_len(self.buf, OPEN)
                    self.emit_content(self.take(len(self.buf) - keep))
                    return
                self.emit_content(self.take(start))
                self.take(len(OPEN))
                self.state, self.reader = "call", JsonCallReader(self, ("arguments", "parameters"))
            if self.state == "call":
                step = self.reader.step(final)
                if step == WAIT:
                    return
                self.state = "tail" if step == DONE else "body"
            if self.state == "tail":
                end = self.buf.find(CLOSE)
                if end < 0:
                    keep = 0 if final else held_prefix_len(self.buf, CLOSE)
                    self.take(len(self.buf) - keep)
                    return
                self.take(end + len(CLOSE))
                self.state = "text"
            if self.state == "body":          # not streamable: decided once the call is closed
                end, _ = self.find(CLOSE)
                if end < 0 and not final:
                    return
                body = self.take(len(self.buf) if end < 0 else end)
                closing = self.take(len(CLOSE)) if end >= 0 else ""
                call = self.call_from_json(json_or_none(body))
                if call is None:
                    self.emit_content(OPEN + body + closing)
                else:
                    self.emit_whole_call(*call)
                self.state = "text"
                if end < 0:
                    return


class Llama3JsonToolParser(StreamingToolParser):
    """Llama 3.x JSON calls: the output is `{"name": ..., "parameters": {...}}` (several
    separated by `;`), optionally after `<|python_tag|>`. Output that does not start with a
    call is content, all of it; text after the calls is content too."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "start"     # start -> call -> between -> call ... | content
        self.prefix = ""         # a <|python_tag|> that is content unless a call follows
        self.reader: JsonCallReader | None = None
        self.whole: WholeObjectReader | None = None

    def _to_content(self, text: str = "") -> None:
        self.emit_content(self.prefix + text)
        self.prefix, self.state = "", "content"

    def advance(self, final: bool) -> None:
        while True:
            if self.state == "content":
                self.emit_content(self.take(len(self.buf)))
                return
            if self.state in ("start", "between"):
                head = self.buf.lstrip()
                lead = self.take(len(self.buf) - len(head))
                if self.prefix:              # after <|python_tag|>: content unless a call follows
                    self.prefix += lead
                else:
                    self.emit_content(lead)
                if not head:
                    if final and self.prefix:
                        self._to_content()
                    return
                if self.state == "start" and not self.prefix:
                    if head.startswith(PYTHON_TAG):
                        self.prefix = self.take(len(PYTHON_TAG))
                        continue
                    if PYTHON_TAG.startswith(head) and not final:
                        return
                if self.state == "between" and head[0] == ";":
                    self.take(1)
                    continue
                if head[0] != "{":
                    self._to_content()
                    continue
                self.state, self.reader = "call", JsonCallReader(self, ("parameters", "arguments"))
            if self.state == "call":
                step = self.reader.step(final)
                if step == WAIT:
                    return
                if step == REJECT:
                    self.state, self.whole = "whole", WholeObjectReader(self)
            if self.state == "whole":
                status, text = self.whole.step(final)
                if status == WAIT:
                    return
                if status == REJECT:
                    self._to_content(text)
                    continue
            self.prefix, self.state = "", "between"
