"""One OpenAI (chat) completion request over HTTP: start its n choices (per prompt: a
completions batch is prompts x n), then answer with one JSON body or an SSE stream that
interleaves the choices' chunks as they come."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.common import pb
from services.gateway.openai.choices import ChoiceBuilder, ChoiceGroup, ChoiceSpec
from services.gateway.clients.request_handle import Delta
from services.gateway.http.respond import respond
from services.gateway.openai.format import sse, usage
from services.gateway.service import Gateway
from services.gateway.http.sse import coalesce
from services.gateway.timing import RequestTimer
from services.gateway.timing import track as track_timing


@dataclass
class PromptIn:
    """One prompt of a request: its token ids and the text its choices echo."""
    ids: list[int]
    echo: str = ""


class _Body:
    def __init__(self, chat: bool, request_id: str, model: str, include_usage: bool,
                 timer: RequestTimer | None = None, continuous_usage: bool = False) -> None:
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.whole_object = "chat.completion" if chat else "text_completion"
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage   # vLLM: the choice's usage on every chunk
        self.timer = timer   # set when the client asked for a timing breakdown

    def envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, choices: list, handle=None, extra: dict | None = None) -> str:
        """One SSE chunk; `handle`: the choice's engine request (continuous usage)."""
        body = self.envelope(self.object, choices)
        if extra:
            body.update(extra)
        if self.include_usage:
            body["usage"] = usage(handle) if self.continuous_usage and handle is not None else None
        return sse(body)


async def _stream(body: _Body, group: ChoiceGroup, builders: list[ChoiceBuilder],
                  first: tuple[int, Delta], state) -> AsyncIterator[str]:
    """The SSE events, joined per wake-up: all the deltas queued by then are coalesced."""
    try:
        handles = group.handles
        parts = [body.chunk([choice], handles[b.index], extra)
                 for b in builders for choice, extra in b.opening()]
        pending = coalesce([first, *group.ready()])
        ended = False
        while not ended:
            for index, delta in pending:
                if delta.error is not None:
                    if state.outcome != "client_disconnected":
                        state.outcome = f"error:{delta.error.kind}"
                    parts.append(sse(delta.error.to_openai()))
                    ended = True
                    break
                parts.extend(body.chunk([choice], handles[index])
                             for choice in builders[index].stream(delta))
                if all(b.done for b in builders):
                    if body.include_usage or body.timer is not None:
                        final = body.envelope(body.object, [])
                        if body.include_usage:
                            final["usage"] = usage(group)
                        if body.timer is not None:  # the last chunk before [DONE]
                            final["timing"] = body.timer.breakdown_of_last(group.handles)
                        parts.append(sse(final))
                    ended = True
                    break
            if not ended:
                if parts:
                    yield "".join(parts)
                    parts = []
                pending = coalesce([await anext(group), *group.ready()])
        parts.append(sse("[DONE]"))
        yield "".join(parts)
    except asyncio.CancelledError:
        state.outcome = "client_disconnected"
        raise
    finally:
        group.abort()  # no-op for finished choices; stops the rest in the engine


async def _collect(group: ChoiceGroup, builders: list[ChoiceBuilder],
                   first: tuple[int, Delta]) -> None:
    index, delta = first
    while True:
        if delta.error is not None:
            raise delta.error
        builders[index].add(delta)
        if all(b.done for b in builders):
            return
        index, delta = await anext(group)


def _start(gw: Gateway, req, request_id: str, prompts: Sequence[PromptIn],
           sampling: "pb.common.SamplingParams", param: str) -> list:
    """n engine requests per prompt (prompt p's ids are `<id>-p<p>...` in a batch)."""
    handles: list = []
    try:
        for p, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-p{p}"
            handles += gw.start_n(rid, prompt.ids, sampling, req.num_choices, prompt_param=param,
                                  priority=req.priority, cache_salt=req.cache_salt or "")
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    return handles


async def generate(request: Request, gw: Gateway, req, request_id: str,
                   prompts: list[int] | Sequence[PromptIn],
                   sampling: "pb.common.SamplingParams", spec: ChoiceSpec,
                   timer: RequestTimer) -> Response:
    """Start `req`'s n choices per prompt and answer: JSON, or SSE when it asked to stream.
    `req` is the parsed CompletionRequest / ChatCompletionRequest (n, stream, usage, priority,
    salt); `prompts` one prompt's token ids (echoing spec.echo) or a batch of PromptIn."""
    if not prompts or not isinstance(prompts[0], PromptIn):
        prompts = [PromptIn(list(prompts), spec.echo)]
    n, stream, model = req.num_choices, bool(req.stream), req.model or gw.model_name
    if not req.return_timing:
        timer = None
    handles = _start(gw, req, request_id, prompts, sampling, "messages" if spec.chat else "prompt")
    if timer is not None:
        track_timing(handles)
    group = ChoiceGroup(request_id, handles, n)
    request.state.handle = group
    builders = [ChoiceBuilder(p * n + j, spec, echo=prompt.echo, prompt_ids=prompt.ids)
                for p, prompt in enumerate(prompts) for j in range(n)]
    body = _Body(spec.chat, request_id, model, req.include_usage, timer,
                 getattr(req, "continuous_usage", False))
    streamed = (lambda first: _stream(body, group, builders, first, request.state)) if stream else None
    resp = await respond(request, group, streamed, lambda first: _collect(group, builders, first))
    if resp is not None:
        return resp
    out = body.envelope(body.whole_object, [b.whole() for b in builders])
    # The SDK's declared fields, null as vLLM sends them: a client's model_dump() has the keys the
    # raw JSON has (vLLM's own /invocations test compares them).
    out["system_fingerprint"] = None
    if spec.chat:
        out.update(service_tier=None, metadata=None, moderation=None)
    if spec.chat and spec.return_token_ids:   # vLLM: chat's prompt ids are on the response
        out["prompt_token_ids"] = prompts[0].ids
    if spec.chat:   # vLLM: chat's prompt_logprobs are on the response (null unless asked for)
        out["prompt_logprobs"] = builders[0].prompt_logprobs()
    out["usage"] = usage(group)
    if timer is not None:
        out["timing"] = timer.breakdown_of_last(handles)
    return JSONResponse(out)
