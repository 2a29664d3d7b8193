"""`POST /invocations` and `GET|POST /ping` (SageMaker's inference and health routes, as vLLM
serves them). /ping answers as /health (open, like it). In /invocations the body's shape picks
the route. `messages` -> chat completions, `prompt` -> completions, `input` ->
embeddings; that route then validates the body as its own (the same 400s). A body that is none
of them is a 400 naming what would be accepted."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import RootModel

from services.common.json_limits import json_depth_exceeds
from services.gateway.embeddings import EmbeddingRequest
from services.gateway.errors import invalid
from services.gateway.http.body import read_body
from services.gateway.http.completions import create_chat_completion, create_completion
from services.gateway.openai.protocol import (MAX_JSON_DEPTH, ChatCompletionRequest,
                                              CompletionRequest)
from services.gateway.service import Gateway
from services.gateway.timing import RequestTimer

# The key that picks the route, in vLLM's order of trying (chat, completions, embeddings).
ROUTE_KEYS = ("messages", "prompt", "input")


class InvocationRequest(RootModel[ChatCompletionRequest | CompletionRequest | EmbeddingRequest]):
    """The body of /v1/chat/completions, /v1/completions or /v1/embeddings (GET /openapi.json's
    schema of this route; the route itself dispatches on the keys, then validates once)."""


def route_of(body: bytes) -> str:
    """Which of ROUTE_KEYS the body is for (400 when it is no JSON object or has none)."""
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if isinstance(value, dict):
        for key in ROUTE_KEYS:
            if key in value:
                return key
    raise invalid("cannot find a route for this body: /invocations takes a chat completions "
                  "body (messages), a completions body (prompt) or an embeddings body (input)")


def add_invocation_routes(app: FastAPI, gw: Gateway) -> None:
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        if gw.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        timer = RequestTimer()
        body = await read_body(request, gw.config.max_body_bytes)
        key = route_of(body)
        if key == "messages":
            return await create_chat_completion(request, gw, body, timer)
        if key == "prompt":
            return await create_completion(request, gw, body, timer)
        return JSONResponse(await gw.embeddings.create_openai(body, request.state.request_id))
