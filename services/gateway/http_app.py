"""The OpenAI-compatible HTTP API (FastAPI), served by uvicorn on the gateway's loop."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import pb
from services.gateway.engine_client import Delta, RequestHandle
from services.gateway.errors import ApiError
from services.gateway.openai_format import Formatter, sse
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.service import Gateway, new_request_id, sane_client_id

log = logging.getLogger("meshllm.gateway.http")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


class RequestContext:
    """ASGI middleware: a request id on every response and one log line per request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        supplied = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = sane_client_id(supplied.decode("latin-1")) or new_request_id("req")
        state = scope.setdefault("state", {})
        state["request_id"], state["handle"], state["outcome"] = rid, None, "ok"
        status, start = 0, time.monotonic()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            state["outcome"] = "cancelled"
            raise
        finally:
            handle: RequestHandle | None = state.get("handle")
            level = logging.DEBUG if scope.get("path") == "/health" else logging.INFO
            log.log(level, "request id=%s route=%s %s status=%s outcome=%s engine_id=%s "
                    "prompt_tokens=%s completion_tokens=%s finish=%s latency_ms=%.1f",
                    rid, scope.get("method"), scope.get("path"), status, state["outcome"],
                    handle.request_id if handle else "-",
                    handle.num_prompt_tokens if handle else 0,
                    handle.num_completion_tokens if handle else 0,
                    handle.finish_reason if handle else "-", (time.monotonic() - start) * 1e3)


async def read_body(request: Request, limit: int) -> bytes:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError("unsupported_media", f"Content-Encoding {encoding!r} is not supported")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError("too_large", f"the request body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError("too_large", f"the request body is larger than {limit} bytes")
    return bytes(body)


async def _until_disconnect(request: Request) -> None:
    # The body is fully read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _watch(request: Request, handle: RequestHandle, awaitable):
    """Await `awaitable`, aborting the request in the engine if the client goes away."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        handle.abort()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    handle.abort()
    raise ClientGone()


async def _collect(first: Delta, deltas: AsyncIterator[Delta]) -> tuple[str, Delta]:
    parts, last = [first.text], first
    while not last.last:
        last = await anext(deltas)
        parts.append(last.text)
    return "".join(parts), last


async def _sse(fmt: Formatter, handle: RequestHandle, first: Delta,
               deltas: AsyncIterator[Delta], state) -> AsyncIterator[str]:
    try:
        if fmt.chat:
            yield fmt.role_chunk()
        delta = first
        while True:
            if delta.error is not None:
                state.outcome = f"error:{delta.error.kind}"
                yield sse(delta.error.to_openai())
                break
            if delta.text or delta.last:
                yield fmt.delta_chunk(delta.text, delta.finish_reason, delta.stop_reason)
            if delta.last:
                break
            delta = await anext(deltas)
        if fmt.include_usage:
            yield fmt.usage_chunk(handle)
        yield sse("[DONE]")
    except asyncio.CancelledError:
        state.outcome = "client_disconnected"
        raise
    finally:
        handle.abort()  # no-op when it finished; stops it in the engine otherwise


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="meshllm gateway", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        request.state.outcome = f"error:{err.kind}"
        headers = {"Retry-After": "1"} if err.http_status in (429, 503) else None
        return JSONResponse(err.to_openai(), status_code=err.http_status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if err.status_code == 404 else "invalid_argument"
        body = ApiError(kind, str(err.detail)).to_openai()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(ApiError("internal", "internal server error").to_openai(),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if gw.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    def model_card() -> dict:
        return {"id": gw.model_name, "object": "model", "created": started,
                "owned_by": "meshllm", "root": gw.model_name, "max_model_len": gw.max_model_len}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        gw.check_model(model)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_body(request, gw.config.max_body_bytes))
        gw.check_model(req.model)
        sampling = req.to_sampling()
        prompt_ids = (await gw.tokenize_text(req.prompt) if isinstance(req.prompt, str)
                      else req.prompt)
        return await _generate(request, req, new_request_id("cmpl"), prompt_ids, sampling,
                               chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_body(request, gw.config.max_body_bytes))
        gw.check_model(req.model)
        sampling = req.to_sampling()
        prompt_ids = await gw.tokenize_chat(req.to_chat_messages(), req.add_generation_prompt,
                                            req.continue_final_message)
        return await _generate(request, req, new_request_id("chatcmpl"), prompt_ids, sampling,
                               chat=True)

    async def _generate(request: Request, req, request_id: str, prompt_ids: list[int],
                        sampling: "pb.common.SamplingParams", chat: bool) -> Response:
        handle = gw.start(request_id, prompt_ids, sampling,
                          prompt_param="messages" if chat else "prompt")
        request.state.handle = handle
        fmt = Formatter(chat, request_id, int(time.time()), req.model or gw.model_name,
                        include_usage=req.include_usage)
        deltas = aiter(handle)
        try:
            # Wait for the first step before committing to 200, so early failures get a status.
            first = await _watch(request, handle, anext(deltas))
            if first.error is not None:
                raise first.error
            if req.stream:
                return StreamingResponse(_sse(fmt, handle, first, deltas, request.state),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            text, last = await _watch(request, handle, _collect(first, deltas))
        except ClientGone:
            request.state.outcome = "client_disconnected"
            return Response(status_code=499)
        if last.error is not None:
            raise last.error
        return JSONResponse(fmt.full(text, last.finish_reason, last.stop_reason, handle))

    return app


def with_request_context(app: FastAPI):
    return RequestContext(app)
