"""Output parsers selected by --reasoning-parser and --tool-call-parser (see base.py)."""
from __future__ import annotations

from collections.abc import Callable

from services.gateway.parsers.base import (OutputParser, ParsedDelta, ParsedOutput,
                                           ReasoningParser, ToolCall, ToolCallDelta, ToolParser,
                                           new_tool_call_id)
from services.gateway.parsers.reasoning import deepseek_r1, qwen3
from services.gateway.parsers.tools import HermesToolParser, Llama3JsonToolParser

REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": deepseek_r1, "qwen3": qwen3}
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def make_output_parser(reasoning: str | None, tool: str | None, *,
                       allowed_tools: set[str] | None = None,
                       id_factory: Callable[[], str] = new_tool_call_id) -> OutputParser | None:
    """A fresh parser for one choice, or None when neither parser applies."""
    if not reasoning and not tool:
        return None
    return OutputParser(REASONING_PARSERS[reasoning]() if reasoning else None,
                        TOOL_PARSERS[tool](allowed_tools, id_factory) if tool else None)


__all__ = ["OutputParser", "ParsedDelta", "ParsedOutput", "REASONING_PARSERS", "TOOL_PARSERS",
           "ToolCall", "ToolCallDelta", "make_output_parser"]
