"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`, over the chat path (tokenize_chat, start_n, the output
parsers, the forced-tool grammar). Every failure on these routes answers in Anthropic's
error shape (anthropic/errors.py); `x-api-key` is read by guard/auth.py."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.anthropic.convert import (ChatPrompt, chat_prompt, new_message_id,
                                               new_tool_use_id)
from services.gateway.anthropic.errors import error_body, error_event
from services.gateway.anthropic.events import MessageBuilder, usage
from services.gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from services.gateway.clients.request_handle import Delta
from services.gateway.errors import ApiError, invalid
from services.gateway.http.body import read_body
from services.gateway.http.respond import respond
from services.gateway.http.sse import coalesce
from services.gateway.openai.chat_tools import decode_for_parsers
from services.gateway.openai.choices import ChoiceGroup
from services.gateway.openai.protocol import parse_body
from services.gateway.openai.tool_grammar import tool_call_grammar
from services.gateway.parsers import make_output_parser
from services.gateway.service import Gateway

log = logging.getLogger("meshllm.gateway.http")


def _request_id(request: Request) -> dict[str, str]:
    """Anthropic's `request-id` header (the client exposes it as `_request_id`)."""
    rid = getattr(request.state, "request_id", None)
    return {"request-id": rid} if rid else {}


def _error(request: Request, err: ApiError) -> JSONResponse:
    request.state.outcome = f"error:{err.kind}"
    headers = _request_id(request)
    if err.retry_after_s:
        headers["Retry-After"] = str(err.retry_after_s)
    rid = getattr(request.state, "request_id", None)
    return JSONResponse(error_body(err, rid), status_code=err.http_status, headers=headers)


async def _prompt_ids(gw: Gateway, prompt: ChatPrompt) -> list[int]:
    return await gw.tokenize_chat(prompt.messages, prompt.add_generation_prompt,
                                  prompt.continue_final_message, tools_json=prompt.plan.tools_json,
                                  chat_template_kwargs_json=prompt.template_kwargs_json)


async def _stream(builder: MessageBuilder, group: ChoiceGroup, first: tuple[int, Delta],
                  state) -> AsyncIterator[str]:
    """The events, joined per wake-up: the deltas queued by then are coalesced."""
    try:
        parts = builder.opening(usage(group))
        pending = coalesce([first, *group.ready()])
        while True:
            for _, delta in pending:
                if delta.error is not None:
                    if state.outcome != "client_disconnected":
                        state.outcome = f"error:{delta.error.kind}"
                    yield "".join(parts) + error_event(delta.error, getattr(state, "request_id", None))
                    return
                parts += builder.stream(delta)
                if builder.done:
                    yield "".join(parts + builder.closing(usage(group)))
                    return
            if parts:
                yield "".join(parts)
                parts = []
            pending = coalesce([await anext(group), *group.ready()])
    except asyncio.CancelledError:
        state.outcome = "client_disconnected"
        raise
    finally:
        group.abort()  # no-op once finished; stops the engine request otherwise


async def _collect(builder: MessageBuilder, group: ChoiceGroup, first: tuple[int, Delta]) -> None:
    delta = first[1]
    while True:
        if delta.error is not None:
            raise delta.error
        builder.add(delta)
        if builder.done:
            return
        delta = (await anext(group))[1]


async def _create(request: Request, gw: Gateway) -> Response:
    cfg = gw.config
    req = parse_body(MessagesRequest, await read_body(request, cfg.max_body_bytes))
    gw.check_model(req.model)
    sampling = req.to_sampling()
    prompt = chat_prompt(req, cfg.tool_call_parser, cfg.reasoning_parser)
    structured_param = "output_config"
    if prompt.plan.forced:   # any / tool: the output is tool calls, enforced by a grammar
        if sampling.HasField("structured"):
            raise invalid(f"tool_choice {req.tool_choice.type!r} already constrains the output: "
                          "it cannot be combined with output_config.format", "tool_choice")
        structured_param = "tool_choice"
        sampling.structured.grammar = tool_call_grammar(
            prompt.tools, prompt.plan.allowed_names, cfg.tool_call_parser, cfg.reasoning_parser,
            parallel=prompt.parallel_tool_calls)
    # Before any tokenizer work, as chat does.
    await gw.check_sampling(sampling, req.rule_options(), structured_param)
    prompt_ids = await _prompt_ids(gw, prompt)
    tool_parser = cfg.tool_call_parser if prompt.plan.parse_tool_calls else None
    decode_for_parsers(sampling, cfg.reasoning_parser, tool_parser)   # markers that are special tokens
    message_id = new_message_id()
    handles = gw.start_n(message_id, prompt_ids, sampling, 1, prompt_param="messages")
    group = ChoiceGroup(message_id, handles)
    request.state.handle = group
    parser = make_output_parser(cfg.reasoning_parser, tool_parser,
                                allowed_tools=prompt.plan.allowed_names,
                                id_factory=new_tool_use_id, tools=prompt.tools)
    omit = getattr(req.thinking, "display", None) == "omitted"
    builder = MessageBuilder(message_id, req.model, parser, req.thinking_on, omit)
    streamed = (lambda first: _stream(builder, group, first, request.state)) if req.stream else None
    resp = await respond(request, group, streamed, lambda first: _collect(builder, group, first),
                        headers=_request_id(request))
    if resp is not None:
        return resp
    return JSONResponse(builder.message(usage(group)), headers=_request_id(request))


async def _count_tokens(request: Request, gw: Gateway) -> Response:
    cfg = gw.config
    req = parse_body(CountTokensRequest, await read_body(request, cfg.max_body_bytes))
    gw.check_model(req.model)
    prompt = chat_prompt(req, cfg.tool_call_parser, cfg.reasoning_parser)
    return JSONResponse({"input_tokens": len(await _prompt_ids(gw, prompt))},
                        headers=_request_id(request))


def add_message_routes(app: FastAPI, gw: Gateway) -> None:
    async def answer(request: Request, handler) -> Response:
        try:
            return await handler(request, gw)
        except ApiError as err:
            return _error(request, err)
        except Exception:
            log.exception("internal error")
            return _error(request, ApiError("internal", "internal server error"))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await answer(request, _create)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await answer(request, _count_tokens)
