"""OpenAI response bodies and SSE chunks (plain dicts, as the official client expects)."""
from __future__ import annotations

import json

from services.gateway.engine_client import RequestHandle


def usage(handle: RequestHandle) -> dict:
    out = {"prompt_tokens": handle.num_prompt_tokens,
           "completion_tokens": handle.num_completion_tokens,
           "total_tokens": handle.num_prompt_tokens + handle.num_completion_tokens}
    if handle.num_cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": handle.num_cached_tokens}
    return out


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class Formatter:
    """Builds the bodies of one request, completions or chat."""

    def __init__(self, chat: bool, request_id: str, created: int, model: str,
                 include_usage: bool = False) -> None:
        self.chat, self.id, self.created, self.model = chat, request_id, created, model
        self.include_usage = include_usage

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, text: str, finish_reason: str | None, stop_reason, handle: RequestHandle) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(handle)
        return body

    def _chunk(self, choice: dict) -> str:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def role_chunk(self) -> str:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta_chunk(self, text: str, finish_reason: str | None = None, stop_reason=None) -> str:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._chunk(choice)

    def usage_chunk(self, handle: RequestHandle) -> str:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(handle)
        return sse(body)
