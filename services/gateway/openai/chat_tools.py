"""`tools` / `tool_choice` / `chat_template_kwargs` of a chat request -> what the template
gets and how the output is parsed.

`required` and a named function render the tools (only the named one) and are enforced: the
output is constrained to the tool-call parser's format with arguments that validate against
each allowed tool's schema (openai/tool_grammar.py), so every returned call parses and
validates. `auto` stays free: only calls to the rendered functions become `tool_calls`
(others stay content)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import invalid
from services.gateway.parsers import needs_special_tokens

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    tools_json: str                   # for the chat template; "" = no tools rendered
    parse_tool_calls: bool
    allowed_names: set[str] | None    # None = any rendered tool
    forced: bool = False              # required / named: the output must be tool calls


def _tool_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"parameters\": {...}}}", "tools")
    return fn["name"]


def plan_tools(tools: list[dict] | None, tool_choice: Any, tool_parser: str | None) -> ToolPlan:
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    names = [_tool_name(t, i) for i, t in enumerate(tools)]
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("", False, None)
    if not tools:
        raise invalid(f"tool_choice {choice!r} needs a non-empty tools list", "tool_choice")
    if not tool_parser:
        raise invalid("tool calling needs the server started with --tool-call-parser "
                      "(docs/parsers.md lists them)", "tools")
    if choice in ("auto", "required"):
        return ToolPlan(json.dumps(tools), True, set(names), forced=choice == "required")
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise invalid(f"tool_choice names function {name!r}, which is not in tools",
                          "tool_choice")
        return ToolPlan(json.dumps([tools[names.index(name)]]), True, {name}, forced=True)
    raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def template_kwargs_json(kwargs: dict[str, Any] | None) -> str:
    """The request's chat_template_kwargs as JSON for the tokenizer, which refuses names
    the render sets itself (its INVALID_ARGUMENT comes back as a 400)."""
    if not kwargs:
        return ""
    try:
        return json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise invalid(f"chat_template_kwargs must be plain JSON: {e}", "chat_template_kwargs")


def decode_for_parsers(sampling, reasoning_parser: str | None, tool_parser: str | None) -> None:
    """Keep special tokens in the decoded text when the request's parsers read markers that are
    special tokens (Mistral's [TOOL_CALLS], Kimi K2's call sections, gpt-oss's harmony channels):
    skipped, they would never reach the parser. `sampling`: the request's pb SamplingParams."""
    if needs_special_tokens(reasoning_parser, tool_parser):
        sampling.skip_special_tokens = False
