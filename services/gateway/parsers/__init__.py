"""Output parsers selected by --reasoning-parser and --tool-call-parser, under vLLM's names
(see base.py for the interface, docs/parsers.md for every format)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.gateway.parsers.base import (OutputParser, ParsedDelta, ParsedOutput,
                                           ReasoningParser, ToolCall, ToolCallDelta, ToolParser,
                                           new_tool_call_id)
from services.gateway.parsers.harmony import HarmonyOutputParser, HarmonyReader
from services.gateway.parsers.mistral import MistralToolParser
from services.gateway.parsers.reasoning import deepseek_r1, qwen3, seed_oss
from services.gateway.parsers.sections import (DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                               KimiK2ToolParser)
from services.gateway.parsers.tools import HermesToolParser, Llama3JsonToolParser
from services.gateway.parsers.xml_calls import Qwen3CoderToolParser, SeedOssToolParser

# gpt-oss: its harmony channels carry reasoning, content and calls at once, so either name
# selects the one reader for both halves (HarmonyOutputParser).
HARMONY_REASONING = ("openai_gptoss", "gpt_oss")
HARMONY_TOOLS = ("openai",)

REASONING_PARSERS: dict[str, Callable[[], ReasoningParser] | None] = {
    "deepseek_r1": deepseek_r1, "qwen3": qwen3, "seed_oss": seed_oss,
    **{name: None for name in HARMONY_REASONING}}
TOOL_PARSERS: dict[str, type[ToolParser] | None] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser, "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser, "kimi_k2": KimiK2ToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "seed_oss": SeedOssToolParser,
    **{name: None for name in HARMONY_TOOLS}}


def _schemas(tools: list[dict] | None) -> dict[str, Any]:
    """Tool name -> its parameters schema, from a request's `tools` (already validated)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    return out


def needs_special_tokens(reasoning: str | None, tool: str | None) -> bool:
    """Whether these parsers read markers that are special tokens, so the text they parse must
    be decoded with skip_special_tokens off."""
    if reasoning in HARMONY_REASONING or tool in HARMONY_TOOLS:
        return True
    t = TOOL_PARSERS.get(tool) if tool else None
    return bool(t is not None and t.needs_special_tokens)


def make_output_parser(reasoning: str | None, tool: str | None, *,
                       allowed_tools: set[str] | None = None,
                       id_factory: Callable[[], str] | None = None,
                       tools: list[dict] | None = None) -> OutputParser | None:
    """A fresh parser for one choice, or None when neither parser applies. `tools`: the
    request's tools (the XML formats type their parameters by the schemas)."""
    if not reasoning and not tool:
        return None
    if reasoning in HARMONY_REASONING or tool in HARMONY_TOOLS:
        return HarmonyOutputParser(HarmonyReader(allowed_tools, id_factory,
                                                 parse_calls=tool in HARMONY_TOOLS))
    return OutputParser(REASONING_PARSERS[reasoning]() if reasoning else None,
                        TOOL_PARSERS[tool](allowed_tools, id_factory, _schemas(tools)) if tool else None)


__all__ = ["OutputParser", "ParsedDelta", "ParsedOutput", "REASONING_PARSERS", "TOOL_PARSERS",
           "ToolCall", "ToolCallDelta", "make_output_parser", "needs_special_tokens",
           "new_tool_call_id"]
