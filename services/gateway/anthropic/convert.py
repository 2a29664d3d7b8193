"""Anthropic Messages <-> the gateway's chat: the prompt (system, turns, tools, tool_choice,
thinking) as chat messages and a tool plan, and the output's parsed pieces as content blocks.

- `system` becomes the first (system) chat message; text blocks are joined with newlines.
- An assistant turn's `tool_use` blocks become its `tool_calls` (OpenAI's shape, which the
  chat templates read); a user turn's `tool_result` blocks become `tool` messages (in block
  order, before the turn's text); `is_error` results are prefixed "Error: ".
- Earlier `thinking` / `redacted_thinking` blocks are accepted and not rendered (chat
  templates drop past reasoning too).
- A conversation ending on an assistant turn is a prefill: the output continues it.
- `tools` -> OpenAI function tools; `tool_choice` auto / any / tool / none -> auto / required /
  the named function / none, so `any` and `tool` are enforced by openai/tool_grammar.py."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from services.common import pb
from services.gateway.anthropic.protocol import (DocumentBlock, ImageBlock, MessageIn,
                                                 PromptRequest, RedactedThinkingBlock, TextBlock,
                                                 ThinkingBlock, ToolResultBlock, ToolUseBlock)
from services.gateway.errors import invalid
from services.gateway.openai.chat_tools import ToolPlan, plan_tools
from services.gateway.openai.protocol import check_tools
from services.gateway.parsers import ParsedOutput


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ChatPrompt:
    """What the tokenizer renders for one Messages request, and how its output is read."""
    messages: list["pb.common.ChatMessage"]
    add_generation_prompt: bool
    continue_final_message: bool
    tools: list[dict]              # OpenAI function tools (for the grammar of a forced call)
    plan: ToolPlan
    parallel_tool_calls: bool
    template_kwargs_json: str


def _unreadable(block, where: str):
    kind = "image" if isinstance(block, ImageBlock) else "document"
    return invalid(f"{where}: {kind} blocks are not supported: the served model reads text only",
                   "messages")


def _result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None:
        text = ""
    elif isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise _unreadable(part, f"{where}.content.{k}")
            parts.append(part.text)
        text = "\n".join(parts)
    return "Error: " + text if block.is_error else text


def _turn(message: MessageIn, i: int, seen_tool_ids: set[str]) -> list["pb.common.ChatMessage"]:
    """One Anthropic turn as chat messages (tool results first, in order)."""
    if isinstance(message.content, str):
        return [pb.common.ChatMessage(role=message.role, content=message.content)]
    out: list[pb.common.ChatMessage] = []
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unreadable(block, where)
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            if message.role != "assistant":
                raise invalid(f"{where}: {block.type} blocks belong to assistant turns", "messages")
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise invalid(f"{where}: tool_use blocks belong to assistant turns", "messages")
            seen_tool_ids.add(block.id)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise invalid(f"{where}: tool_result blocks belong to user turns", "messages")
            if block.tool_use_id not in seen_tool_ids:
                raise invalid(f"{where}: tool_result answers tool_use id {block.tool_use_id!r}, "
                              "which no earlier assistant turn used", "messages")
            if texts:   # text before a result stays before it
                out.append(pb.common.ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            out.append(pb.common.ChatMessage(role="tool", content=_result_text(block, where),
                                             tool_call_id=block.tool_use_id))
    if message.role == "assistant":
        out.append(pb.common.ChatMessage(role="assistant", content="\n".join(texts),
                                         tool_calls_json=json.dumps(calls) if calls else ""))
    elif texts or not out:
        out.append(pb.common.ChatMessage(role="user", content="\n".join(texts)))
    return out


def _tools(req: PromptRequest) -> tuple[list[dict], object, bool]:
    """(OpenAI tools, OpenAI tool_choice, parallel) of the request."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.input_schema.get("type") != "object":
            raise invalid(f"tools.{i}.input_schema: must be a JSON Schema with type \"object\"",
                          "tools")
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        tools.append({"type": "function", "function": fn})
    if tools:
        check_tools(tools)
    choice = req.tool_choice
    if choice is None:
        return tools, None, True
    parallel = not getattr(choice, "disable_parallel_tool_use", None)
    if choice.type in ("any", "tool") and not tools:
        raise invalid(f"tool_choice {choice.type!r} needs a non-empty tools list", "tool_choice")
    if choice.type == "tool" and choice.name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names tool {choice.name!r}, which is not in tools",
                      "tool_choice")
    if choice.type == "any":
        return tools, "required", parallel
    if choice.type == "tool":
        return tools, {"type": "function", "function": {"name": choice.name}}, parallel
    return tools, choice.type, parallel          # auto | none


def chat_prompt(req: PromptRequest, tool_parser: str | None,
                reasoning_parser: str | None) -> ChatPrompt:
    if not req.messages:
        raise invalid("messages: must contain at least one message", "messages")
    if req.thinking_on and not reasoning_parser:
        raise invalid("thinking needs a reasoning model: start the server with --reasoning-parser",
                      "thinking")
    messages: list[pb.common.ChatMessage] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else \
            "\n".join(block.text for block in req.system)
        messages.append(pb.common.ChatMessage(role="system", content=system))
    seen_tool_ids: set[str] = set()
    for i, message in enumerate(req.messages):
        messages.extend(_turn(message, i, seen_tool_ids))
    prefill = req.messages[-1].role == "assistant"
    if prefill and messages[-1].tool_calls_json:
        raise invalid(f"messages.{len(req.messages) - 1}: the conversation ends on tool_use "
                      "blocks: send their tool_result blocks in a user turn", "messages")
    tools, choice, parallel = _tools(req)
    plan = plan_tools(tools, choice, tool_parser)
    # With a reasoning parser, the template is told whether to think (Qwen3's enable_thinking).
    kwargs = json.dumps({"enable_thinking": req.thinking_on}) if reasoning_parser else ""
    return ChatPrompt(messages, not prefill, prefill, tools, plan, parallel, kwargs)


def stop_reason_of(finish_reason: str | None, stop_reason, num_tool_calls: int
                   ) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) of a finished output."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return ("tool_use" if num_tool_calls else "end_turn"), None


def content_blocks(parsed: ParsedOutput, thinking: bool, omit_thinking: bool = False) -> list[dict]:
    """The whole output's content blocks: thinking (when asked for), text, tool_use."""
    blocks: list[dict] = []
    if thinking and parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": "" if omit_thinking else parsed.reasoning,
                       "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": _tool_input(call.arguments)})
    return blocks


def _tool_input(arguments: str) -> dict:
    """A call's input; {} for arguments cut off by max_tokens (the stop_reason says so; the
    stream's input_json_delta events carry the text that was generated)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
