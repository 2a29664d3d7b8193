"""The n choices of one OpenAI request: n engine requests merged into one response.

`ChoiceGroup` multiplexes the engine requests (and duck-types a RequestHandle for the
request log line and usage); `ChoiceBuilder` turns one choice's Deltas into OpenAI choice
objects, streamed (chunks) or whole, through the output parser when one is configured.

A completions batch (several prompts) is one group too: choice index = prompt_index * n + j,
as OpenAI numbers them; usage counts each prompt once."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.clients.request_handle import Delta, RequestHandle
from services.gateway.openai.logprobs import (CompletionLogprobs, chat_content, merge_completion,
                                              token_id_strings)
from services.gateway.openai.prompt_logprobs import PromptPart, prepend
from services.gateway.parsers import OutputParser, ToolCallDelta


class ChoiceGroup:
    def __init__(self, request_id: str, handles: list[RequestHandle], n: int | None = None) -> None:
        """`n`: choices per prompt (handles of prompt p are handles[p*n:(p+1)*n]); default: all
        handles share one prompt."""
        self.request_id = request_id
        self.handles = handles
        self._firsts = handles[::n or len(handles) or 1]  # one handle per prompt
        # Every handle puts its (choice index, Delta) pairs straight into this queue.
        self._queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        for i, handle in enumerate(handles):
            handle.route_to(self._queue, i)

    # -- what the request log line and usage read ---------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return sum(h.num_prompt_tokens for h in self._firsts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(h.num_completion_tokens for h in self.handles)

    @property
    def num_cached_tokens(self) -> int:
        return sum(h.num_cached_tokens for h in self._firsts)

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
    echo: str = ""                                  # text to prefix (completions: the prompt)
    new_parser: Callable[[], OutputParser | None] = lambda: None
    role: str = "assistant"                         # chat: the answer's role (vLLM's rule)
    return_token_ids: bool = False                  # vLLM: prompt_token_ids / token_ids
    tokens_as_ids: bool = False                     # vLLM: logprob tokens as "token_id:<id>"
    prompt_logprobs: bool = False                   # vLLM: prompt_logprobs (openai/prompt_logprobs.py)
    echo_only: bool = False                         # completions echo with max_tokens 0: the prompt alone


def _tool_call_json(tc: ToolCallDelta) -> dict:
    if tc.name is not None:
        return {"index": tc.index, "id": tc.id, "type": "function",
                "function": {"name": tc.name, "arguments": tc.arguments}}
    return {"index": tc.index, "function": {"arguments": tc.arguments}}


class ChoiceBuilder:
    def __init__(self, index: int, spec: ChoiceSpec, *, echo: str | None = None,
                 prompt_ids: list[int] | None = None) -> None:
        """`echo` and `prompt_ids`: this choice's own (a batch's prompts differ); `echo`
        defaults to the spec's."""
        self.index, self.spec = index, spec
        self.echo = spec.echo if echo is None else echo
        self.prompt_ids = list(prompt_ids or [])
        self.parser = spec.new_parser() if spec.chat else None
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self._prompt_ids_sent = False
        self.lps: list = []
        self.strings: dict[int, str] = {}
        self.lp_parts: list[dict] = []
        self.completion_lp = CompletionLogprobs(len(self.echo))
        self.prompt_part = PromptPart(self.prompt_ids, spec.tokens_as_ids)
        # Completions echo with logprobs: the echo waits for the prompt's logprobs (first Delta).
        self._echo_lps = bool(self.echo) and spec.logprobs and spec.prompt_logprobs and not spec.chat
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.done = False

    def _finish(self, delta: Delta) -> None:
        self.done = True
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if self.parser is not None and self.parser.num_tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"

    # -- streaming ------------------------------------------------------------------------
    def opening(self) -> list[tuple[dict, dict]]:
        """The chunks sent before any output: (choice, extra top-level fields of its chunk).
        Chat: the role, then the echo; vLLM puts prompt_token_ids on the role chunk."""
        if self.spec.chat:
            top = {"prompt_token_ids": self.prompt_ids} if self.spec.return_token_ids else {}
            out = [({"index": self.index, "delta": {"role": self.spec.role, "content": ""},
                     "logprobs": None, "finish_reason": None}, top)]
            if self.echo:
                out.append(({"index": self.index, "delta": {"content": self.echo},
                             "logprobs": None, "finish_reason": None}, {}))
            return out
        if self.echo and not self._echo_lps:
            return [(self._with_token_ids({"index": self.index, "text": self.echo,
                                           "logprobs": None, "finish_reason": None}, []), {})]
        return []

    def _echo_part(self, delta: Delta) -> dict | None:
        """Completions echo with logprobs: the prompt's logprobs on the choice's first Delta, and
        the completion's text offsets continue after the prompt's tokens (vLLM)."""
        if not (self._echo_lps and self.prompt_part.take(delta)):
            return None
        part, self.completion_lp.offset = self.prompt_part.echo()
        return part

    def _with_token_ids(self, choice: dict, token_ids: list[int]) -> dict:
        """A completions chunk's vLLM token fields: prompt_token_ids on the choice's first."""
        if self.spec.return_token_ids:
            if not self._prompt_ids_sent:
                choice["prompt_token_ids"] = self.prompt_ids
                self._prompt_ids_sent = True
            choice["token_ids"] = list(token_ids)
        return choice

    def _token_strings(self, delta: Delta) -> dict[int, str]:
        return token_id_strings(delta.logprobs) if self.spec.tokens_as_ids else delta.token_strings

    def _visible(self, delta: Delta) -> Delta:
        """echo_only: the engine's one token is not part of the answer (its end and the prompt's
        logprobs are)."""
        if not self.spec.echo_only:
            return delta
        return Delta("", [], delta.finish_reason, delta.stop_reason, delta.error, [], delta.num_cached_tokens,
                     delta.token_strings, delta.prompt_logprobs)

    def stream(self, delta: Delta) -> list[dict]:
        """The choice objects (one per chunk) for one Delta."""
        delta = self._visible(delta)
        want_lp = self.spec.logprobs and bool(delta.logprobs)
        want_ids = self.spec.return_token_ids and bool(delta.token_ids)
        if not self.spec.chat:
            if delta.last:
                self._finish(delta)
            echo_part = self._echo_part(delta)   # vLLM: the echo goes with the first token
            if not (delta.text or delta.last or want_lp or want_ids or echo_part):
                return []
            lps = self.completion_lp.chunk(delta.logprobs, self._token_strings(delta)) if want_lp else None
            choice = {"index": self.index,
                      "text": delta.text if echo_part is None else self.echo + delta.text,
                      "logprobs": lps if echo_part is None else prepend(echo_part, lps),
                      "finish_reason": self.finish_reason}
            if delta.last:
                choice["stop_reason"] = self.stop_reason
            return [self._with_token_ids(choice, delta.token_ids)]
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
        if not pieces and (want_lp or want_ids or delta.last):
            pieces = [{}]
        choices = [{"index": self.index, "delta": p, "logprobs": None, "finish_reason": None}
                   for p in pieces]
        if self.spec.return_token_ids:   # the delta's tokens on its first chunk
            for i, choice in enumerate(choices):
                choice["token_ids"] = list(delta.token_ids) if i == 0 else []
        if want_lp:
            choices[0]["logprobs"] = {"content": chat_content(delta.logprobs,
                                                              self._token_strings(delta))}
        if delta.last:
            choices[-1]["finish_reason"] = self.finish_reason
            choices[-1]["stop_reason"] = self.stop_reason
        return choices

    def prompt_logprobs(self) -> list | None:
        """vLLM's prompt_logprobs of this choice's prompt (None: not asked for)."""
        return self.prompt_part.vllm() if self.spec.prompt_logprobs else None

    # -- whole ----------------------------------------------------------------------------
    def add(self, delta: Delta) -> None:
        delta = self._visible(delta)
        echo_part = self._echo_part(delta)
        if echo_part is not None:
            self.lp_parts.append(echo_part)
        elif self.spec.prompt_logprobs:
            self.prompt_part.take(delta)
        self.parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if self.spec.logprobs and delta.logprobs:
            if self.spec.chat:
                self.lps.extend(delta.logprobs)
                self.strings.update(self._token_strings(delta))
            else:
                self.lp_parts.append(self.completion_lp.chunk(delta.logprobs,
                                                              self._token_strings(delta)))
        if delta.last:
            self._finish(delta)

    def whole(self) -> dict:
        text = "".join(self.parts)
        ids = ({"prompt_token_ids": self.prompt_ids, "token_ids": self.token_ids}
               if self.spec.return_token_ids else {})
        if not self.spec.chat:
            return {"index": self.index, "text": self.echo + text,
                    "logprobs": merge_completion(self.lp_parts) if self.spec.logprobs else None,
                    "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, **ids,
                    "prompt_logprobs": self.prompt_logprobs()}
        message: dict = {"role": self.spec.role, "content": text}
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
        if self.echo:   # vLLM: the echo prefixes the parsed content
            message["content"] = self.echo + (message["content"] or "")
        for key in ("refusal", "annotations", "audio", "function_call"):   # the SDK's fields, null
            message.setdefault(key, None)
        message.setdefault("tool_calls", [])   # vLLM's default
        out = {"index": self.index, "message": message,
               "logprobs": ({"content": chat_content(self.lps, self.strings)}
                            if self.spec.logprobs else None),
               "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        if self.spec.return_token_ids:   # chat: prompt_token_ids is on the response, not the choice
            out["token_ids"] = self.token_ids
        return out
