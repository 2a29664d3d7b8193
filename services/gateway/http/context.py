"""ASGI middleware around every HTTP request: its request id, one log line, the HTTP metrics."""
from __future__ import annotations

import asyncio
import logging
import time

from services.common.metrics import current_trace_exemplar
from services.gateway.http.metrics import RouteNames, record_http
from services.gateway.ids import new_request_id, sane_client_id
from services.gateway.tracing import with_tracing

log = logging.getLogger("meshllm.gateway.http")


class RequestContext:
    """A request id on every response (the client's X-Request-Id when sane), one log line and
    the HTTP metrics (http/metrics.py) per request. Routes that start engine work put their
    handle in `scope["state"]["handle"]` so the log line names it."""

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
                exemplar = current_trace_exemplar()  # the request span (tracing.py) is current here
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            state["outcome"] = "cancelled"
            raise
        finally:
            handle = state.get("handle")
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


def with_request_context(app):
    # Tracing inside RequestContext: the request span sees its request id and outcome.
    return RequestContext(with_tracing(app), app.routes)
