"""The chat fields the gRPC API takes as JSON text (`ChatInput.tools_json`,
`chat_template_kwargs_json`, each message's `tool_calls_json`), held to the limits the HTTP API
applies to the same fields, so no input reaches the tokenizer over gRPC that HTTP would refuse:
nesting is checked on the text before it is parsed (a deep one would exhaust the parser's
recursion), then sizes, shapes, the tool count and the tool-call parser requirement
(openai/chat_tools.plan_tools, which the HTTP route runs too)."""
from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import invalid
from services.gateway.openai.chat_tools import plan_tools
from services.common.json_limits import json_depth_exceeds
from services.gateway.openai.protocol import MAX_JSON_DEPTH, MAX_TOOLS_DEPTH, MAX_TOOLS_JSON_BYTES


def _parse(text: str, param: str, kind: type, max_depth: int, max_bytes: int | None = None) -> Any:
    raw = text.encode("utf-8")
    if max_bytes is not None and len(raw) > max_bytes:
        raise invalid(f"{param} must be at most {max_bytes} bytes of JSON, got {len(raw)}", param)
    if json_depth_exceeds(raw, max_depth):
        raise invalid(f"{param} nests JSON deeper than {max_depth} levels", param)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, kind):
        raise invalid(f"{param} must be a JSON {'array' if kind is list else 'object'}", param)
    return value


def check_chat_input(chat, tool_parser: str | None, *, render_only: bool = False) -> None:
    """Refuse (400 / INVALID_ARGUMENT) what HTTP refuses in the same fields. `render_only`: the
    tools are only rendered (Tokenize), so no tool-call parser is needed."""
    if chat.tools_json:
        tools = _parse(chat.tools_json, "chat.tools_json", list, MAX_TOOLS_DEPTH, MAX_TOOLS_JSON_BYTES)
        plan_tools(tools, "auto" if tools else "none", "render-only" if render_only else tool_parser)
    if chat.chat_template_kwargs_json:
        _parse(chat.chat_template_kwargs_json, "chat.chat_template_kwargs_json", dict, MAX_JSON_DEPTH)
    for i, message in enumerate(chat.messages):
        if message.tool_calls_json:
            _parse(message.tool_calls_json, f"chat.messages[{i}].tool_calls_json", list, MAX_JSON_DEPTH)
