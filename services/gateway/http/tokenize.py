"""vLLM's POST /tokenize and POST /detokenize (same request and response shapes)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from services.gateway.openai.chat_tools import plan_tools, template_kwargs_json
from services.gateway.errors import invalid
from services.gateway.guard.sampling import check_token_ids
from services.gateway.http.body import read_body
from services.gateway.openai.protocol import ChatCompletionRequest, ChatMessageIn, parse_body
from services.gateway.service import Gateway


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""
    model_config = ConfigDict(extra="forbid", strict=True)  # unknown fields: a 400 naming them
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None   # default: true for prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # unknown fields: a 400 naming them
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = parse_body(TokenizeRequest, await read_body(request, gw.config.max_body_bytes))
        gw.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await gw.tokenizer.encode(req.prompt, add) if req.prompt else []
        else:
            if req.add_generation_prompt and req.continue_final_message:
                raise invalid("add_generation_prompt and continue_final_message cannot both be "
                              "true", "continue_final_message")
            chat = ChatCompletionRequest(messages=req.messages)
            plan = plan_tools(req.tools, "none" if not req.tools else "auto", "render-only")
            ids = await gw.tokenize_chat(
                chat.to_chat_messages(), req.add_generation_prompt, req.continue_final_message,
                tools_json=plan.tools_json,
                chat_template_kwargs_json=template_kwargs_json(req.chat_template_kwargs))
        strs = None
        if req.return_token_strs:   # vLLM: the vocabulary's strings (convert_ids_to_tokens)
            strs = await gw.tokenizer.convert_ids_to_tokens(ids) if ids else []
        return JSONResponse({"count": len(ids), "max_model_len": gw.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = parse_body(DetokenizeRequest, await read_body(request, gw.config.max_body_bytes))
        gw.check_model(req.model)
        check_token_ids(req.tokens, gw.limits().vocab_size, "tokens")
        text = (await gw.tokenizer.decode([req.tokens], True))[0] if req.tokens else ""
        return JSONResponse({"prompt": text})
