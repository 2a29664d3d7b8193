"""`tool_choice: "required"` or a named function as a grammar: the output is forced into the active
tool-call parser's format, each call naming an allowed tool with arguments that validate against
that tool's `parameters` schema, so every call the parser returns parses and validates. Formats:
hermes and llama3_json (JSON calls, arguments embedded as %json) and qwen3_coder (XML calls: each
parameter's value typed as the parser types it; string patterns and formats are not enforced).

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


FORCEABLE = ("hermes", "llama3_json", "qwen3_coder")


_CLOSE = '"\\n</parameter>\\n"'
_CLOSE_RX = r"\n<\/parameter>\n"
_MARKED = r"(.|\n)*(<parameter=|<\/parameter>|<\/function>)(.|\n)*"


def _xml_value(rule: str, schema: Any) -> list[str]:
    """Rules for one Qwen3-Coder parameter value, typed as the parser types it (xml_calls.py):
    strings are raw text (an enum: one of its literals; maxLength bounds the length), every
    other type is its JSON text embedded as %json. String patterns and formats are not enforced."""
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string" or (kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"])):
        if schema.get("enum"):
            return [f"{rule}: (" + " | ".join(_literal(str(v)) for v in schema["enum"]) + f") {_CLOSE}"]
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        reps = f"{{{lo},{int(hi)}}}" if hi is not None else ("+" if lo else "*")
        # A lazy lexeme ends at its shortest match: the closing tag is part of it, so the value
        # ends at the first "\n</parameter>\n"; and it may not hold a marker the parser would
        # read as the next parameter or the end of the function (llguidance's `& ~`).
        return [f"{rule}[lazy]: /(.|\\n){reps}{_CLOSE_RX}/ & ~/{_MARKED}{_CLOSE_RX}/"]
    return [f"{rule}: %json {json.dumps(schema or {})} {_CLOSE}"]


def _xml_call(i: int, name: str, params: dict) -> list[str]:
    r"""`<tool_call>\n<function=NAME>\n` + one `<parameter=P>\nVALUE\n</parameter>\n` per
    property (required ones always, the others optional, in the schema's order) + `</function>\n</tool_call>`."""
    if "<" in name or ">" in name:
        raise invalid("tool names must not contain '<' or '>' with the qwen3_coder parser", "tools")
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    rules, parts = [], []
    for j, (prop, sub) in enumerate(props.items()):
        if "<" in prop or ">" in prop:
            raise invalid("parameter names must not contain '<' or '>' with the qwen3_coder parser", "tools")
        rules += _xml_value(f"value_{i}_{j}", sub)
        rules.append(f'param_{i}_{j}: {_literal(f"<parameter={prop}>")} "\\n" value_{i}_{j}')
        parts.append(f"param_{i}_{j}" + ("" if prop in required else "?"))
    head = _literal(f"<function={name}>")
    rules.append(f'call_{i}: "<tool_call>\\n" {head} "\\n" {" ".join(parts)} "</function>\\n</tool_call>"')
    return rules


def tool_call_grammar(tools: list[dict[str, Any]], allowed: set[str], tool_parser: str,
                      reasoning_parser: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar forcing at least one call (several when `parallel`) to the `allowed`
    tools, in the format of `tool_parser` (FORCEABLE: hermes | llama3_json | qwen3_coder)."""
    if tool_parser not in FORCEABLE:
        raise invalid(f"tool_choice cannot be enforced for the tool-call parser {tool_parser!r} "
                      f"(enforced for: {', '.join(FORCEABLE)})", "tool_choice")
    args_key = "arguments" if tool_parser == "hermes" else "parameters"
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name not in allowed:
            continue
        alternatives.append(f"call_{i}")
        if tool_parser == "qwen3_coder":
            rules += _xml_call(i, name, _parameters(tool))
            continue
        head = _literal('{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{args_key}": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(_parameters(tool))}")
    if not alternatives:
        raise invalid("tool_choice allows no tool of the request", "tool_choice")
    rules.append("call: " + " | ".join(alternatives))
    if tool_parser == "hermes":
        rules.append(r'wrapped: "<tool_call>\n" call "\n</tool_call>"')
        calls = 'wrapped ("\\n" wrapped)*' if parallel else "wrapped"
    elif tool_parser == "qwen3_coder":
        calls = 'call ("\\n" call)*' if parallel else "call"
    else:
        calls = 'call ("; " call)*' if parallel else "call"
    prefix, prefix_rules = _reasoning_prefix(reasoning_parser)
    return "\n".join([f"start: {prefix}calls", f"calls: {calls}", *rules, *prefix_rules]) + "\n"
