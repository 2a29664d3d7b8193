"""Tool calls in a section of marker tokens: DeepSeek V3, DeepSeek V3.1 and Kimi K2.

    content <SECTION_BEGIN> <CALL_BEGIN> head <ARGS_BEGIN> arguments <ARGS_END> ... <SECTION_END> content

The head names the function; the arguments stream as they are generated, without the
whitespace around them (a call with none gets `{}`). A call to a function the request did not
allow stays in the content, verbatim, markers included."""
from __future__ import annotations

from services.gateway.parsers.base import held_prefix_len
from services.gateway.parsers.streaming import END_OF_SEQUENCE, StreamingToolParser


def _find_any(buf: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the first marker in `buf`, or (-1, "")."""
    hits = [(buf.find(m), m) for m in markers if m in buf]
    return min(hits) if hits else (-1, "")


def _held(buf: str, markers: tuple[str, ...]) -> int:
    return max(held_prefix_len(buf, m) for m in markers)


class SectionToolParser(StreamingToolParser):
    # Whether the tokenizer marks these markers special differs by release: keep special tokens
    # in the text either way (the end-of-sequence text that then closes it is dropped).
    needs_special_tokens = True
    end_strings = END_OF_SEQUENCE
    SECTION_BEGIN: tuple[str, ...] = ()
    SECTION_END: tuple[str, ...] = ()
    CALL_BEGIN = ""
    ARGS_BEGIN = ""          # ends the head
    ARGS_END = ""            # ends the arguments
    CALL_END = ""            # ends the call (may equal ARGS_END)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"  # text -> section -> head -> args -> (tail) -> section ... -> text
        self._arg_ws = ""    # whitespace inside the arguments, held until more follows

    def head_call(self, head: str) -> tuple[str, str | None] | None:
        """(function name, call id or None for a fresh one) of a call head, or None."""
        raise NotImplementedError

    def advance(self, final: bool) -> None:
        while getattr(self, "_" + self.state)(final):
            pass

    # -- each state: consume what it can; True to go on, False to wait for more text --------
    def _text(self, final: bool) -> bool:
        start, marker = _find_any(self.buf, self.SECTION_BEGIN)
        if start < 0:
            keep = 0 if final else _held(self.buf, self.SECTION_BEGIN)
            self.emit_content(self.take(len(self.buf) - keep))
            return False
        self.emit_content(self.take(start))
        self.take(len(marker))
        self.state = "section"
        return True

    def _section(self, final: bool) -> bool:
        self.take(len(self.buf) - len(self.buf.lstrip()))   # whitespace between calls
        if self.buf.startswith(self.CALL_BEGIN):
            self.take(len(self.CALL_BEGIN))
            self.state = "head"
            return True
        end, marker = _find_any(self.buf, self.SECTION_END)
        if end == 0:
            self.take(len(marker))
            self.state = "text"
            return True
        nxt, _ = _find_any(self.buf, (self.CALL_BEGIN, *self.SECTION_END))
        if nxt < 0:            # stray text inside the section is content
            keep = 0 if final else _held(self.buf, (self.CALL_BEGIN, *self.SECTION_END))
            self.emit_content(self.take(len(self.buf) - keep))
            return False
        self.emit_content(self.take(nxt))
        return True

    def _head(self, final: bool) -> bool:
        end, _ = self.find(self.ARGS_BEGIN)
        if end < 0:
            if final:
                self.emit_content(self.CALL_BEGIN + self.take(len(self.buf)))
            return False
        head = self.buf[:end]
        call = self.head_call(head)
        if call is None or not self.allowed(call[0]):
            self.state = "rejected"
            return True
        self.take(end + len(self.ARGS_BEGIN))
        self.open_call(*call)
        self._arg_ws, self.state = "", "args"
        return True

    def _args(self, final: bool) -> bool:
        end = self.buf.find(self.ARGS_END)
        text = self.take(len(self.buf) if end < 0 else end)
        if end < 0 and not final:
            keep = held_prefix_len(text, self.ARGS_END)
            self.buf, text = text[len(text) - keep:], text[:len(text) - keep]
        text = self._arg_ws + text
        body = text.rstrip()
        if self._args_blank:
            body = body.lstrip()
        self._arg_ws = text[len(text.rstrip()):]
        self.emit_args(body)
        if end < 0:
            return False
        self.take(len(self.ARGS_END))
        self.close_call()
        self.state = "section" if self.ARGS_END == self.CALL_END else "tail"
        return True

    def _tail(self, final: bool) -> bool:
        end = self.buf.find(self.CALL_END)
        if end < 0:
            keep = 0 if final else held_prefix_len(self.buf, self.CALL_END)
            self.take(len(self.buf) - keep)
            return False
        self.take(end + len(self.CALL_END))
        self.state = "section"
        return True

    def _rejected(self, final: bool) -> bool:
        end, _ = self.find(self.CALL_END)
        if end < 0 and not final:
            return False
        text = self.take(len(self.buf) if end < 0 else end + len(self.CALL_END))
        self.emit_content(self.CALL_BEGIN + text)
        self.state = "section"
        return end >= 0


_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(SectionToolParser):
    """`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`."""
    SECTION_BEGIN, SECTION_END = (_DS_CALLS_BEGIN,), (_DS_CALLS_END,)
    CALL_BEGIN, ARGS_BEGIN, ARGS_END, CALL_END = _DS_CALL_BEGIN, "```json", "```", _DS_CALL_END

    def head_call(self, head: str):
        kind, sep, name = head.partition(_DS_SEP)
        name = name.strip()
        return (name, None) if sep and name and kind.strip() == "function" else None


class DeepSeekV31ToolParser(SectionToolParser):
    """`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""
    SECTION_BEGIN, SECTION_END = (_DS_CALLS_BEGIN,), (_DS_CALLS_END,)
    CALL_BEGIN, ARGS_BEGIN, ARGS_END, CALL_END = _DS_CALL_BEGIN, _DS_SEP, _DS_CALL_END, _DS_CALL_END

    def head_call(self, head: str):
        name = head.strip()
        return (name, None) if name else None


class KimiK2ToolParser(SectionToolParser):
    """`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`;
    the call id is the model's own `functions.NAME:IDX` (its template renders history by it)."""
    SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    CALL_BEGIN, ARGS_BEGIN = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
    ARGS_END = CALL_END = "<|tool_call_end|>"

    def head_call(self, head: str):
        call_id = head.strip()
        ref, _, _index = call_id.partition(":")
        name = ref.split(".", 1)[1] if ref.startswith("functions.") else ref
        return (name, call_id) if name and call_id else None
