"""`POST /v1/completions` and `POST /v1/chat/completions`: parse, tokenize, then generate."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.common import pb
from services.gateway.errors import invalid
from services.gateway.http.body import read_body
from services.gateway.http.generate import PromptIn, generate
from services.gateway.ids import new_request_id
from services.gateway.openai.chat_tools import decode_for_parsers, plan_tools, template_kwargs_json
from services.gateway.openai.choices import ChoiceSpec
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.openai.truncation import check_truncation, truncate_prompt
from services.gateway.openai.tool_grammar import tool_call_grammar
from services.gateway.parsers import make_output_parser
from services.gateway.service import Gateway
from services.gateway.timing import RequestTimer


def enforce_tool_calls(sampling: "pb.common.SamplingParams", req: ChatCompletionRequest,
                       allowed: set[str], cfg) -> None:
    """Constrain the output to calls of the allowed tools (openai/tool_grammar.py)."""
    if sampling.HasField("structured"):
        raise invalid(f"tool_choice {req.tool_choice!r} already constrains the output: it cannot be "
                      f"combined with {req.structured_param}", "tool_choice")
    sampling.structured.grammar = tool_call_grammar(
        req.tools, allowed, cfg.tool_call_parser, cfg.reasoning_parser,
        parallel=req.parallel_tool_calls is not False)


def _check_truncation(gw: Gateway, req) -> None:
    check_truncation(req.truncate_prompt_tokens, req.truncation_side, gw.max_model_len)


def _truncated(gw: Gateway, req, prompt_ids: list[int]) -> list[int]:
    return truncate_prompt(prompt_ids, req.truncate_prompt_tokens, req.truncation_side,
                           gw.max_model_len)


async def completion_prompts(gw: Gateway, req: CompletionRequest,
                             timer: RequestTimer) -> list[PromptIn]:
    """Each prompt of the batch as token ids (truncated as asked) with its echo text: the text
    as sent, or the decoded ids (token-id prompts and truncated ones)."""
    texts = [p for p in req.prompts if isinstance(p, str)]
    t0 = timer.tokenize_started()
    encoded = iter(await asyncio.gather(*(gw.tokenize_text(t) for t in texts)))
    if texts:
        timer.tokenize_done(t0)
    prompts, to_decode = [], []
    for prompt in req.prompts:
        given = next(encoded) if isinstance(prompt, str) else list(prompt)
        ids = _truncated(gw, req, given)
        echo = prompt if isinstance(prompt, str) and len(ids) == len(given) else None
        prompts.append(PromptIn(ids, echo or ""))
        if req.echo and echo is None and ids:
            to_decode.append(len(prompts) - 1)
    if not req.echo:
        for prompt in prompts:
            prompt.echo = ""
    elif to_decode:
        texts = await gw.tokenizer.decode([prompts[i].ids for i in to_decode], False)
        for i, text in zip(to_decode, texts):
            prompts[i].echo = text
    return prompts


async def create_completion(request: Request, gw: Gateway, body: bytes,
                            timer: RequestTimer) -> Response:
    """One /v1/completions body (also reached through /invocations)."""
    req = parse_body(CompletionRequest, body)
    gw.check_model(req.model)
    sampling = req.to_sampling()
    # Before any tokenizer work; refusals of the output constraint name the field it came in.
    await gw.check_sampling(sampling, req.rule_options(), req.structured_param)
    _check_truncation(gw, req)
    prompts = await completion_prompts(gw, req, timer)
    spec = ChoiceSpec(chat=False, logprobs=req.logprobs is not None,
                      return_token_ids=bool(req.return_token_ids),
                      tokens_as_ids=bool(req.return_tokens_as_token_ids),
                      prompt_logprobs=sampling.HasField("prompt_logprobs"), echo_only=req.echo_only)
    return await generate(request, gw, req, new_request_id("cmpl"), prompts, sampling, spec, timer)


async def create_chat_completion(request: Request, gw: Gateway, body: bytes,
                                 timer: RequestTimer) -> Response:
    """One /v1/chat/completions body (also reached through /invocations)."""
    cfg = gw.config
    req = parse_body(ChatCompletionRequest, body)
    gw.check_model(req.model)
    sampling = req.to_sampling()
    plan = plan_tools(req.tools, req.tool_choice, cfg.tool_call_parser)
    structured_param = req.structured_param
    if plan.forced:   # required / named: the output is tool calls, enforced by a grammar
        enforce_tool_calls(sampling, req, plan.allowed_names, cfg)
        structured_param = "tools"
    # Before any tokenizer work; refusals of the output constraint name the field it came in.
    await gw.check_sampling(sampling, req.rule_options(), structured_param)
    _check_truncation(gw, req)
    t0 = timer.tokenize_started()
    prompt_ids = await gw.tokenize_chat(
        req.to_chat_messages(), req.add_generation_prompt, req.continue_final_message,
        tools_json=plan.tools_json,
        chat_template_kwargs_json=template_kwargs_json(req.chat_template_kwargs))
    timer.tokenize_done(t0)
    prompt_ids = _truncated(gw, req, prompt_ids)
    tool_parser = cfg.tool_call_parser if plan.parse_tool_calls else None
    decode_for_parsers(sampling, cfg.reasoning_parser, tool_parser)
    spec = ChoiceSpec(chat=True, logprobs=bool(req.logprobs), echo=req.echo_text(),
                      role=req.response_role, return_token_ids=bool(req.return_token_ids),
                      tokens_as_ids=bool(req.return_tokens_as_token_ids),
                      prompt_logprobs=sampling.HasField("prompt_logprobs"),
                      new_parser=lambda: make_output_parser(cfg.reasoning_parser, tool_parser,
                                                            allowed_tools=plan.allowed_names,
                                                            tools=req.tools))
    return await generate(request, gw, req, new_request_id("chatcmpl"), prompt_ids, sampling,
                          spec, timer)


def add_completion_routes(app: FastAPI, gw: Gateway) -> None:
    limit = gw.config.max_body_bytes

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        timer = RequestTimer()
        return await create_completion(request, gw, await read_body(request, limit), timer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        timer = RequestTimer()
        return await create_chat_completion(request, gw, await read_body(request, limit), timer)
