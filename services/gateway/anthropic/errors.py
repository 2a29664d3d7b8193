"""Anthropic's error shape for the gateway's ApiError:
`{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}`.

Anthropic's error object has no `param`, so the field an ApiError names leads its message
("max_tokens: ..."), spelled as the Messages API spells it."""
from __future__ import annotations

import json

from services.gateway.errors import ApiError

# ApiError kind -> Anthropic error type (the HTTP status stays the ApiError's).
_TYPES = {
    "invalid_argument": "invalid_request_error",
    "unauthenticated": "authentication_error",
    "permission_denied": "permission_error",
    "not_found": "not_found_error",
    "conflict": "invalid_request_error",
    "too_large": "request_too_large",
    "unsupported_media": "invalid_request_error",
    "resource_exhausted": "rate_limit_error",
    "cancelled": "invalid_request_error",
    "internal": "api_error",
    "unavailable": "overloaded_error",
    "deadline": "timeout_error",
}

# Fields the shared rulebook names by their OpenAI spelling.
_PARAMS = {"stop": "stop_sequences", "prompt": "messages"}


def error_type(err: ApiError) -> str:
    return _TYPES.get(err.kind, "api_error")


def error_body(err: ApiError, request_id: str | None = None) -> dict:
    message = err.message
    param = _PARAMS.get(err.param, err.param) if err.param else None
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    body = {"type": "error", "error": {"type": error_type(err), "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def error_event(err: ApiError, request_id: str | None = None) -> str:
    """A failure after the stream began: Anthropic's `event: error` (the stream ends there)."""
    return f"event: error\ndata: {json.dumps(error_body(err, request_id))}\n\n"


async def send_asgi_error(send, err: ApiError, scope, extra_headers=()) -> None:
    """Answer an ASGI request with `err` in Anthropic's shape, from middleware below the app
    (errors.send_asgi_error's twin: the API-key check of /v1/messages)."""
    state = scope.get("state")
    rid = None
    if isinstance(state, dict):
        state["outcome"] = f"error:{err.kind}"
        rid = state.get("request_id")
    payload = json.dumps(error_body(err, rid)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": err.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
