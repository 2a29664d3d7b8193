"""`POST /v1/completions` and `POST /v1/chat/completions`: parse, tokenize, then generate."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.common import pb
from services.gateway.errors import invalid
from services.gateway.http.body import read_body
from services.gateway.http.generate import generate
from services.gateway.ids import new_request_id
from services.gateway.openai.chat_tools import plan_tools, template_kwargs_json
from services.gateway.openai.choices import ChoiceSpec
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
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


def add_completion_routes(app: FastAPI, gw: Gateway) -> None:
    cfg = gw.config

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        timer = RequestTimer()
        req = parse_body(CompletionRequest, await read_body(request, cfg.max_body_bytes))
        gw.check_model(req.model)
        sampling = req.to_sampling()
        # Before any tokenizer work; refusals of the output constraint name the field it came in.
        await gw.check_sampling(sampling, req.rule_options(), req.structured_param)
        if isinstance(req.prompt, str):
            t0 = timer.tokenize_started()
            prompt_ids = await gw.tokenize_text(req.prompt)
            timer.tokenize_done(t0)
            echo = req.prompt if req.echo else ""
        else:
            prompt_ids = req.prompt
            echo = (await gw.tokenizer.decode([prompt_ids], False))[0] if req.echo and prompt_ids else ""
        spec = ChoiceSpec(chat=False, logprobs=req.logprobs is not None, echo=echo)
        return await generate(request, gw, req, new_request_id("cmpl"), prompt_ids, sampling, spec, timer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        timer = RequestTimer()
        req = parse_body(ChatCompletionRequest, await read_body(request, cfg.max_body_bytes))
        gw.check_model(req.model)
        sampling = req.to_sampling()
        plan = plan_tools(req.tools, req.tool_choice, cfg.tool_call_parser)
        structured_param = req.structured_param
        if plan.forced:   # required / named: the output is tool calls, enforced by a grammar
            enforce_tool_calls(sampling, req, plan.allowed_names, cfg)
            structured_param = "tools"
        # Before any tokenizer work; refusals of the output constraint name the field it came in.
        await gw.check_sampling(sampling, req.rule_options(), structured_param)
        t0 = timer.tokenize_started()
        prompt_ids = await gw.tokenize_chat(
            req.to_chat_messages(), req.add_generation_prompt, req.continue_final_message,
            tools_json=plan.tools_json,
            chat_template_kwargs_json=template_kwargs_json(req.chat_template_kwargs))
        timer.tokenize_done(t0)
        tool_parser = cfg.tool_call_parser if plan.parse_tool_calls else None
        spec = ChoiceSpec(chat=True, logprobs=bool(req.logprobs),
                          new_parser=lambda: make_output_parser(cfg.reasoning_parser, tool_parser,
                                                                allowed_tools=plan.allowed_names))
        return await generate(request, gw, req, new_request_id("chatcmpl"), prompt_ids, sampling,
                              spec, timer)
