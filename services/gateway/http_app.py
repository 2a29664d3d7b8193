"""The OpenAI-compatible HTTP API (FastAPI), served by uvicorn on the gateway's loop."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import pb
from services.gateway.chat_tools import plan_tools, template_kwargs_json
from services.gateway.choices import ChoiceSpec
from services.gateway.engine_client import RequestHandle
from services.gateway.errors import ApiError
from services.gateway.http_generate import generate
from services.gateway.http_tokenize import add_tokenize_routes
from services.gateway.openapi import install as install_openapi
from services.common.metrics import current_trace_exemplar
from services.gateway.metrics import RouteNames, metrics_route, record_http, track_inflight
from services.gateway.parsers import make_output_parser
from services.gateway.profile_routes import add_profile_routes
from services.gateway.admin_routes import add_admin_routes
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.service import Gateway, new_request_id, sane_client_id
from services.gateway.timing import RequestTimer
from services.gateway.tracing_mw import with_tracing

log = logging.getLogger("meshllm.gateway.http")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


class RequestContext:
    """ASGI middleware: a request id on every response, one log line and the HTTP metrics
    (services/gateway/metrics.py) per request."""

    def __init__(self, app, routes=()) -> None:
        self.app = app
        self.route_name = RouteNames(routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        supplied = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = sane_client_id(supplied.decode("latin-1")) or new_request_id("req")
        state = scope.setdefault("state", {})
        state["request_id"], state["handle"], state["outcome"] = rid, None, "ok"
        status, start, exemplar = 0, time.monotonic(), None

        async def send_with_id(message) -> None:
            nonlocal status, exemplar
            if message["type"] == "http.response.start":
                status = message["status"]
                exemplar = current_trace_exemplar()  # the request span (tracing_mw) is current here
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
            path = scope.get("path", "")
            # No response started: the client left (499, as nginx logs it).
            record_http(scope.get("method", ""), self.route_name(path), status or 499,
                        time.monotonic() - start, exemplar)
            level = logging.DEBUG if path in ("/health", "/metrics") else logging.INFO
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


def create_app(gw: Gateway) -> FastAPI:
    # GET /openapi.json with the request-body schemas the raw-body routes validate against.
    app = FastAPI(title="meshllm gateway", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        request.state.outcome = f"error:{err.kind}"
        headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None
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

    # Prometheus scrapes; open like /health (auth.OPEN_HTTP_PATHS), see docs/metrics.md.
    app.add_api_route("/metrics", metrics_route, methods=["GET"], include_in_schema=False)
    track_inflight(gw.model_name, lambda: gw.engine.num_inflight)

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
        return JSONResponse({"object": "list",
                             "data": [model_card(), *await gw.embeddings.model_cards(started)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        embedding_cards = await gw.embeddings.model_cards(started, model)
        if embedding_cards:
            return JSONResponse(embedding_cards[0])
        gw.check_model(model)
        return JSONResponse(model_card())

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = await read_body(request, gw.config.max_body_bytes)
        return JSONResponse(await gw.embeddings.create_openai(body, request.state.request_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        timer = RequestTimer()
        req = parse_body(CompletionRequest, await read_body(request, gw.config.max_body_bytes))
        gw.check_model(req.model)
        sampling = req.to_sampling()
        if isinstance(req.prompt, str):
            t0 = timer.tokenize_started()
            prompt_ids = await gw.tokenize_text(req.prompt)
            timer.tokenize_done(t0)
            echo = req.prompt if req.echo else ""
        else:
            prompt_ids = req.prompt
            echo = (await gw.tokenizer.decode([prompt_ids], False))[0] if req.echo and prompt_ids else ""
        spec = ChoiceSpec(chat=False, logprobs=req.logprobs is not None, echo=echo)
        return await _generate(request, req, new_request_id("cmpl"), prompt_ids, sampling, spec, timer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        timer = RequestTimer()
        req = parse_body(ChatCompletionRequest, await read_body(request, gw.config.max_body_bytes))
        gw.check_model(req.model)
        sampling = req.to_sampling()
        plan = plan_tools(req.tools, req.tool_choice, gw.config.tool_call_parser)
        t0 = timer.tokenize_started()
        prompt_ids = await gw.tokenize_chat(
            req.to_chat_messages(), req.add_generation_prompt, req.continue_final_message,
            tools_json=plan.tools_json,
            chat_template_kwargs_json=template_kwargs_json(req.chat_template_kwargs))
        timer.tokenize_done(t0)
        cfg = gw.config
        tool_parser = cfg.tool_call_parser if plan.parse_tool_calls else None
        spec = ChoiceSpec(chat=True, logprobs=bool(req.logprobs),
                          new_parser=lambda: make_output_parser(cfg.reasoning_parser, tool_parser,
                                                                allowed_tools=plan.allowed_names))
        return await _generate(request, req, new_request_id("chatcmpl"), prompt_ids, sampling,
                               spec, timer)

    async def _generate(request: Request, req, request_id: str, prompt_ids: list[int],
                        sampling: "pb.common.SamplingParams", spec: ChoiceSpec,
                        timer: RequestTimer) -> Response:
        return await generate(request, gw, _watch, ClientGone, request_id=request_id,
                              model=req.model or gw.model_name, prompt_ids=prompt_ids,
                              sampling=sampling, n=req.num_choices, stream=bool(req.stream),
                              include_usage=req.include_usage, spec=spec,
                              priority=req.priority, cache_salt=req.cache_salt or "",
                              timer=timer if req.return_timing else None)

    add_tokenize_routes(app, gw)
    cfg = gw.config
    add_profile_routes(app, cfg.profiler_addr, cfg.internal_tls.channel_credentials(), cfg.max_body_bytes)
    add_admin_routes(app, gw.engine, cfg.supervisor_addr, cfg.internal_tls.channel_credentials(),
                     cfg.max_body_bytes)
    return app


def with_request_context(app: FastAPI):
    # Tracing inside RequestContext: the request span sees its request id and outcome.
    return RequestContext(with_tracing(app), app.routes)
