"""The n choices of one OpenAI request: n engine requests merged into one response.

`ChoiceGroup` multiplexes the engine requests (and duck-types a RequestHandle for the
request log line and usage); `ChoiceBuilder` turns one choice's Deltas into OpenAI choice
objects, streamed (chunks) or whole, through the output parser when one is configured."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.clients.request_handle import Delta, RequestHandle
from services.gateway.openai.logprobs import CompletionLogprobs, chat_content, merge_completion
from services.gateway.parsers import OutputParser, ToolCallDelta


class ChoiceGroup:
    def __init__(self, request_id: str, handles: list[RequestHandle]) -> None:
        self.request_id = request_id
        self.handles = handles
        # Every handle puts its (choice index, Delta) pairs straight into this queue.
        self._queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        for i, handle in enumerate(handles):
            handle.route_to(self._queue, i)

    # -- what the request log line and usage read ---------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return self.handles[0].num_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        return sum(h.num_completion_tokens for h in self.handles)

    @property
    def num_cached_tokens(self) -> int:
        return self.handles[0].num_cached_tokens

    @property
    def finish_reason(self) -> str | None:
        reasons = [h.finish_reason for h in self.handles]
        return reasons[0] if len(set(reasons)) == 1 else ",".join(map(str, reasons))

    # -- the merged stream of (choice index, Delta) --------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        return await self._queue.get()

    def ready(self) -> list[tuple[int, Delta]]:
        """The pairs already queued (without waiting)."""
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    def abort(self) -> None:
        """Stop every choice (no-op for finished ones). Each aborted handle still delivers
        its final (cancelled) delta, so a reader of the group sees the end."""
        for handle in self.handles:
            handle.abort()


@dataclass
class ChoiceSpec:
    chat: bool
    logprobs: bool                                  # return logprobs
    echo: str = ""                                  # completions: prompt text to prefix
    new_parser: Callable[[], OutputParser | None] = lambda: None


def _tool_call_json(tc: ToolCallDelta) -> dict:
    if tc.name is not None:
        return {"index": tc.index, "id": tc.id, "type": "function",
                "function": {"name": tc.name, "arguments": tc.arguments}}
    return {"index": tc.index, "function": {"arguments": tc.arguments}}


class ChoiceBuilder:
    def __init__(self, index: int, spec: ChoiceSpec) -> None:
        self.index, self.spec = index, spec
        self.parser = spec.new_parser() if spec.chat else None
        self.parts: list[str] = []
        self.lps: list = []
        self.strings: dict[int, str] = {}
        self.lp_parts: list[dict] = []
        self.completion_lp = CompletionLogprobs(len(spec.echo))
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.done = False

    def _finish(self, delta: Delta) -> None:
        self.done = True
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if self.parser is not None and self.parser.num_tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"

    # -- streaming ------------------------------------------------------------------------
    def opening(self) -> list[dict]:
        if self.spec.chat:
            return [{"index": self.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]
        if self.spec.echo:
            return [{"index": self.index, "text": self.spec.echo, "logprobs": None,
                     "finish_reason": None}]
        return []

    def stream(self, delta: Delta) -> list[dict]:
        """The choice objects (one per chunk) for one Delta."""
        want_lp = self.spec.logprobs and bool(delta.logprobs)
        if not self.spec.chat:
            if delta.last:
                self._finish(delta)
            if not (delta.text or delta.last or want_lp):
                return []
            choice = {"index": self.index, "text": delta.text,
                      "logprobs": (self.completion_lp.chunk(delta.logprobs, delta.token_strings)
                                   if want_lp else None),
                      "finish_reason": self.finish_reason}
            if delta.last:
                choice["stop_reason"] = self.stop_reason
            return [choice]
        if self.parser is None:
            pieces = [{"content": delta.text}] if delta.text else []
        else:
            parsed = self.parser.feed(delta.text)
            if delta.last:
                tail = self.parser.finish()
                parsed.reasoning += tail.reasoning
                parsed.content += tail.content
                parsed.tool_calls += tail.tool_calls
            pieces = [{"reasoning_content": parsed.reasoning}] if parsed.reasoning else []
            pieces += [{"content": parsed.content}] if parsed.content else []
            pieces += [{"tool_calls": [_tool_call_json(tc)]} for tc in parsed.tool_calls]
        if delta.last:
            self._finish(delta)
        if not pieces and (want_lp or delta.last):
            pieces = [{}]
        choices = [{"index": self.index, "delta": p, "logprobs": None, "finish_reason": None}
                   for p in pieces]
        if want_lp:
            choices[0]["logprobs"] = {"content": chat_content(delta.logprobs, delta.token_strings)}
        if delta.last:
            choices[-1]["finish_reason"] = self.finish_reason
            choices[-1]["stop_reason"] = self.stop_reason
        return choices

    # -- whole ----------------------------------------------------------------------------
    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        if self.spec.logprobs and delta.logprobs:
            if self.spec.chat:
                self.lps.extend(delta.logprobs)
                self.strings.update(delta.token_strings)
            else:
                self.lp_parts.append(self.completion_lp.chunk(delta.logprobs, delta.token_strings))
        if delta.last:
            self._finish(delta)

    def whole(self) -> dict:
        text = "".join(self.parts)
        if not self.spec.chat:
            return {"index": self.index, "text": self.spec.echo + text,
                    "logprobs": merge_completion(self.lp_parts) if self.spec.logprobs else None,
                    "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        message: dict = {"role": "assistant", "content": text}
        if self.parser is not None:
            parsed = self.parser.parse(text)
            message["content"] = parsed.content if parsed.content or not parsed.tool_calls else None
            message["reasoning_content"] = parsed.reasoning or None
            if parsed.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.tool_calls]
                if self.finish_reason == "stop":
                    self.finish_reason = "tool_calls"
        return {"index": self.index, "message": message,
                "logprobs": ({"content": chat_content(self.lps, self.strings)}
                             if self.spec.logprobs else None),
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
