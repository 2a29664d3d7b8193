"""Nesting of JSON text, measured on the bytes before any parser recurses into them (a deep
document would exhaust a recursive parser). Shared by the gateway's body and field checks and
the structured-output bounds."""
from __future__ import annotations

import re

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth_exceeds(body: bytes, max_depth: int) -> bool:
    """Does the JSON text nest deeper than `max_depth`? (brackets inside strings ignored)"""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False  # the common case: too few brackets to nest that deep
    depth = 0
    for b in _JSON_STRING.sub(b'""', body).translate(None, _NOT_BRACKETS):
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False
