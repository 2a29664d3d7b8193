"""One Messages response built from its choice's Deltas: a whole `message` body, or the
stream of events Anthropic sends. Pure: values in, values (dicts / SSE text) out.

Stream, in order: `message_start` (content empty, stop_reason null, the input usage), one
`ping`, then per content block `content_block_start` / `content_block_delta`* /
`content_block_stop` (text_delta for text, thinking_delta + signature_delta for thinking,
input_json_delta for a tool_use's input), then `message_delta` (stop_reason, stop_sequence,
the final usage) and `message_stop`. A block is closed when the next kind of output begins.
Output goes through the configured output parser (reasoning and tool calls), as chat does."""
from __future__ import annotations

import json

from services.gateway.anthropic.convert import content_blocks, stop_reason_of
from services.gateway.clients.request_handle import Delta
from services.gateway.parsers import OutputParser, ParsedDelta, ParsedOutput, ToolCallDelta


def event(obj: dict) -> str:
    """One SSE event in Anthropic's framing: the event name is the object's type."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(handle) -> dict:
    """Anthropic usage of a RequestHandle / ChoiceGroup: `input_tokens` excludes the prompt
    tokens read from the prefix cache (`cache_read_input_tokens`), as Anthropic counts them;
    their sum is the whole prompt."""
    cached = handle.num_cached_tokens
    return {"input_tokens": handle.num_prompt_tokens - cached,
            "output_tokens": handle.num_completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class MessageBuilder:
    def __init__(self, message_id: str, model: str, parser: OutputParser | None,
                 thinking: bool, omit_thinking: bool = False) -> None:
        self.id, self.model, self.parser = message_id, model, parser
        self.thinking, self.omit_thinking = thinking, omit_thinking
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason = None        # the engine's: the stop string or token id
        self.done = False
        # streaming state
        self._index = -1               # index of the last opened block
        self._open: str | None = None  # kind of the open block, None when closed
        self._tool_blocks: dict[int, int] = {}   # parser's tool-call index -> block index
        self._num_tool_calls = 0

    def _envelope(self, content: list, stop: tuple[str | None, str | None], usage_: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage_}

    def _finish(self, delta: Delta) -> None:
        self.done = True
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    # -- whole ----------------------------------------------------------------------------
    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        if delta.last:
            self._finish(delta)

    def message(self, usage_: dict) -> dict:
        text = "".join(self.parts)
        parsed = self.parser.parse(text) if self.parser is not None else ParsedOutput(content=text)
        stop = stop_reason_of(self.finish_reason, self.stop_reason, len(parsed.tool_calls))
        return self._envelope(content_blocks(parsed, self.thinking, self.omit_thinking), stop,
                              usage_)

    # -- streamed -------------------------------------------------------------------------
    def opening(self, usage_: dict) -> list[str]:
        start = self._envelope([], (None, None), {**usage_, "output_tokens": 0})
        return [event({"type": "message_start", "message": start}), event({"type": "ping"})]

    def stream(self, delta: Delta) -> list[str]:
        """The events of one Delta (several blocks may open and close in one)."""
        if self.parser is None:
            parsed = ParsedDelta(content=delta.text)
        else:
            parsed = self.parser.feed(delta.text)
            if delta.last:
                tail = self.parser.finish()
                parsed.reasoning += tail.reasoning
                parsed.content += tail.content
                parsed.tool_calls += tail.tool_calls
        out: list[str] = []
        if parsed.reasoning and self.thinking:
            out += self._text_like("thinking", parsed.reasoning)
        if parsed.content:
            out += self._text_like("text", parsed.content)
        for call in parsed.tool_calls:
            out += self._tool(call)
        if delta.last:
            self._finish(delta)
        return out

    def closing(self, usage_: dict) -> list[str]:
        """After the last Delta: close the open block, then message_delta and message_stop."""
        stop_reason, stop_sequence = stop_reason_of(self.finish_reason, self.stop_reason,
                                                    self._num_tool_calls)
        return [*self._close(), event({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage_}), event({"type": "message_stop"})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":   # Anthropic ends a thinking block with its signature
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self._open = None
        return [*out, event({"type": "content_block_stop", "index": self._index})]

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self._close()
        self._index += 1
        self._open = kind
        return [*out, event({"type": "content_block_start", "index": self._index,
                             "content_block": block})]

    def _delta(self, delta: dict, index: int | None = None) -> str:
        return event({"type": "content_block_delta",
                      "index": self._index if index is None else index, "delta": delta})

    def _text_like(self, kind: str, text: str) -> list[str]:
        out = []
        if self._open != kind:
            empty = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            out += self._start(kind, empty)
        if kind == "text":
            out.append(self._delta({"type": "text_delta", "text": text}))
        elif not self.omit_thinking:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def _tool(self, call: ToolCallDelta) -> list[str]:
        out = []
        if call.name is not None:   # the first fragment of a call: a new tool_use block
            out += self._start("tool_use", {"type": "tool_use", "id": call.id, "name": call.name,
                                            "input": {}})
            self._tool_blocks[call.index] = self._index
            self._num_tool_calls += 1
        if call.arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments},
                                   self._tool_blocks.get(call.index, self._index)))
        return out
