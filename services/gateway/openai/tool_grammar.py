"""`tool_choice: "required"` or a named function as a grammar: the output is forced into the active
tool-call parser's format, each call naming an allowed tool with arguments that validate against
that tool's `parameters` schema, so every call the parser returns parses and validates.

The grammar is Lark in llguidance's dialect (`%json {schema}` embeds a JSON Schema); the worker
enforces it while sampling like any other structured output. With a reasoning parser, the
reasoning comes first and is free text (its end marker is where the constraint starts)."""
from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import invalid

_ANY_ARGS = {"type": "object"}


def _literal(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    if any(ord(c) < 0x20 for c in text):
        raise invalid("tool names must not contain control characters", "tools")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _parameters(tool: dict) -> dict:
    params = tool.get("function", {}).get("parameters")
    if params is None:
        return _ANY_ARGS
    if not isinstance(params, dict):
        raise invalid("a tool's function.parameters must be a JSON Schema object", "tools")
    return params


def _reasoning_prefix(reasoning_parser: str | None) -> tuple[str, list[str]]:
    """(what `start` begins with, the rules it needs) for the reasoning the parser expects."""
    if reasoning_parser == "deepseek_r1":   # the template may have opened <think> already
        return "think ", [r'think[lazy]: /(\s*<think>)?(.|\n)*<\/think>/']
    if reasoning_parser == "qwen3":         # an optional leading <think>...</think>
        return "think? ", [r'think[lazy]: /\s*<think>(.|\n)*<\/think>/']
    return "", []


def tool_call_grammar(tools: list[dict[str, Any]], allowed: set[str], tool_parser: str,
                      reasoning_parser: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar forcing at least one call (several when `parallel`) to the `allowed`
    tools, in the format of `tool_parser` (hermes | llama3_json)."""
    if tool_parser not in ("hermes", "llama3_json"):
        raise invalid(f"tool_choice cannot be enforced for the tool-call parser {tool_parser!r}",
                      "tool_choice")
    args_key = "arguments" if tool_parser == "hermes" else "parameters"
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name not in allowed:
            continue
        head = _literal('{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{args_key}": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(_parameters(tool))}")
        alternatives.append(f"call_{i}")
    if not alternatives:
        raise invalid("tool_choice allows no tool of the request", "tool_choice")
    rules.append("call: " + " | ".join(alternatives))
    if tool_parser == "hermes":
        rules.append(r'wrapped: "<tool_call>\n" call "\n</tool_call>"')
        calls = 'wrapped ("\\n" wrapped)*' if parallel else "wrapped"
    else:
        calls = 'call ("; " call)*' if parallel else "call"
    prefix, prefix_rules = _reasoning_prefix(reasoning_parser)
    return "\n".join([f"start: {prefix}calls", f"calls: {calls}", *rules, *prefix_rules]) + "\n"
