"""Incremental reading of JSON tool calls for the parsers that stream arguments.

- `match_call_header(buf)`: is `buf` the head `{"name": "NAME", "arguments": {` of a call object
  (decided: a `Header`), can it still become one (`PARTIAL`), or is it something else (`NO`)?
- `ObjectScanner`: where an already opened JSON object (or array) ends, one chunk at a time,
  so arguments can be passed on as they arrive and the parser still knows when they stop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

PARTIAL, NO = "partial", "no"
_WS = " \t\r\n"


@dataclass(frozen=True)
class Header:
    name: str
    end: int          # index in the buffer just past the `{` that opens the arguments


def _skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in _WS:
        pos += 1
    return pos


def _string_end(buf: str, pos: int) -> int:
    """Index past the JSON string starting at buf[pos] (a quote), or -1 if it is not closed yet."""
    i = pos + 1
    while i < len(buf):
        ch = buf[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return -1


def match_call_header(buf: str, arg_keys: tuple[str, ...] = ("arguments", "parameters")):
    """Header | PARTIAL | NO for a call object whose `name` comes first and whose arguments are
    an object (`{"name": "f", "arguments": {`); other shapes are NO (the caller then waits for
    the whole object and decides on it)."""
    pos = 0
    for want in ("{", '"name"', ":", None, ",", "key", ":", "{"):
        pos = _skip_ws(buf, pos)
        rest = buf[pos:]
        if want is None:                                   # the name, a JSON string
            if not rest:
                return PARTIAL
            if rest[0] != '"':
                return NO
            end = _string_end(buf, pos)
            if end < 0:
                return PARTIAL
            try:
                name = json.loads(buf[pos:end])
            except ValueError:
                return NO
            pos = end
            continue
        options = [f'"{k}"' for k in arg_keys] if want == "key" else [want]
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return PARTIAL if any(o.startswith(rest) for o in options) else NO
        pos += len(hit)
    return Header(name, pos)


class ObjectScanner:
    """Tracks nesting through JSON text that follows an opening `{` or `[` (strings and their
    escapes respected)."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self._in_string = self._escaped = False

    def scan(self, text: str) -> int:
        """Index in `text` just past the character that closes the object, or -1 when all of
        `text` is still inside it."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1
