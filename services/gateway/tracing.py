"""The gateway's request span: the root of each request's trace (HTTP and public gRPC).

The span is made current (contextvars) for the whole request, so the tokenizer client
puts its traceparent in gRPC metadata and the engine client in EngineSubmit.trace; a
streamed response keeps it open until the last SSE event. Only the gateway starts
traces: it applies the sampling ratio, or follows a client's W3C `traceparent` header.
Prompt and output text never go into a span: only ids, counts and status.
"""
from __future__ import annotations

from services.common import telemetry

# Low-cardinality span names: known routes by path, anything else by method only.
_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models",
                     "/tokenize", "/detokenize", "/profile/start", "/profile/stop", "/profile/status"})
_UNTRACED = frozenset({"/health", "/metrics"})


def with_tracing(app):
    """`app` wrapped in TracingMiddleware when tracing is on; `app` itself when off."""
    return TracingMiddleware(app) if telemetry.ENABLED else app


def _usage_attributes(handle) -> dict:
    """Token counts of the request's engine handle(s) (a RequestHandle or a ChoiceGroup)."""
    if handle is None:
        return {}
    handles = getattr(handle, "handles", None) or [handle]
    attrs = {"gen_ai.usage.input_tokens": int(getattr(handles[0], "num_prompt_tokens", 0)),
             "gen_ai.usage.output_tokens": sum(int(getattr(h, "num_completion_tokens", 0)) for h in handles)}
    reasons = [h.finish_reason for h in handles if getattr(h, "finish_reason", None)]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    return attrs


class TracingMiddleware:
    """Pure ASGI: one SERVER span per HTTP request, current while the app runs."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNTRACED:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        method, path = scope.get("method", ""), scope.get("path", "")
        state = scope.get("state") or {}
        span = telemetry.start_span(
            f"{method} {path}" if path in _ROUTES else method, kind="server", root=True,
            traceparent=headers.get(b"traceparent", b"").decode("latin-1"),
            tracestate=headers.get(b"tracestate", b"").decode("latin-1"),
            attributes={"http.request.method": method, "url.path": path if path in _ROUTES else "other",
                        "meshllm.http_request_id": str(state.get("request_id", ""))})
        if span is None:
            return await self.app(scope, receive, send)
        status = 0

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = telemetry.attach(span)
        error = None
        try:
            await self.app(scope, receive, send_status)
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            telemetry.detach(token)
            attrs = {"http.response.status_code": status, "meshllm.outcome": str(state.get("outcome", ""))}
            attrs.update(_usage_attributes(state.get("handle")))
            if error is None and status >= 500:
                error = f"HTTP {status}"
            telemetry.end_span(span, error=error, attributes=attrs)


def start_grpc_request_span(method: str, context, request_id: str):
    """The root span of a public gRPC call (None when off or not sampled)."""
    if not telemetry.ENABLED:
        return None
    tp, ts = telemetry.traceparent_from_metadata(context.invocation_metadata())
    return telemetry.start_span(f"meshllm.v1.Generation/{method}", kind="server", root=True,
                                traceparent=tp, tracestate=ts,
                                attributes={"rpc.system": "grpc", "rpc.method": method,
                                            "meshllm.request_id": request_id})


def end_grpc_request_span(span, outcome: str, handle) -> None:
    if span is None:
        return
    attrs = {"meshllm.outcome": outcome, **_usage_attributes(handle)}
    telemetry.end_span(span, attributes=attrs,
                       error=outcome if outcome.startswith("error:internal") else None)
