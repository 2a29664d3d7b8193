"""One error class for the gateway, with its HTTP status, OpenAI type and gRPC code."""
from __future__ import annotations

import grpc

from services.common import pb

# kind -> (HTTP status, OpenAI error type, gRPC status)
_KINDS: dict[str, tuple[int, str, grpc.StatusCode]] = {
    "invalid_argument": (400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    "unauthenticated": (401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    "permission_denied": (403, "permission_error", grpc.StatusCode.PERMISSION_DENIED),
    "not_found": (404, "invalid_request_error", grpc.StatusCode.NOT_FOUND),
    "conflict": (409, "invalid_request_error", grpc.StatusCode.ALREADY_EXISTS),
    "too_large": (413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    "unsupported_media": (415, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    "resource_exhausted": (429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    "cancelled": (499, "invalid_request_error", grpc.StatusCode.CANCELLED),
    "internal": (500, "server_error", grpc.StatusCode.INTERNAL),
    "unavailable": (503, "server_error", grpc.StatusCode.UNAVAILABLE),
    "deadline": (504, "server_error", grpc.StatusCode.DEADLINE_EXCEEDED),
}

_FROM_ENGINE = {
    pb.common.ERROR_CODE_INVALID_ARGUMENT: "invalid_argument",
    pb.common.ERROR_CODE_RESOURCE_EXHAUSTED: "resource_exhausted",
    pb.common.ERROR_CODE_UNAVAILABLE: "unavailable",
    pb.common.ERROR_CODE_INTERNAL: "internal",
    pb.common.ERROR_CODE_DEADLINE_EXCEEDED: "deadline",
    pb.common.ERROR_CODE_NOT_FOUND: "not_found",
    pb.common.ERROR_CODE_CANCELLED: "cancelled",
}

_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "unavailable",
}


RETRY_AFTER_S = 1
# Error messages quote the input they refuse (a model name, a field, a value): an error body is
# never larger than these, whatever a client sent (a 3 MB model name gets a 1 KiB answer).
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128
_TAIL_CHARS = 200   # the end of a message says what is wrong ("... does not exist."): keep it


def _bounded(text: str | None, limit: int) -> str | None:
    """`text` cut in the middle to at most `limit` characters, saying how much went."""
    if text is None or len(text) <= limit:
        return text
    tail = min(_TAIL_CHARS, limit // 4)
    cut = f" [... {len(text) - limit} characters truncated ...] "
    keep_head = max(0, limit - tail - len(cut) - 8)  # 8: room for the count's digits to grow
    cut = f" [... {len(text) - keep_head - tail} characters truncated ...] "
    return text[:keep_head] + cut + (text[-tail:] if tail else "")


class ApiError(Exception):
    """A failure of one request, rendered as an OpenAI error body or a gRPC status."""

    def __init__(self, kind: str, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        if kind not in _KINDS:
            raise ValueError(f"unknown error kind {kind!r}")
        message = _bounded(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.kind, self.message, self.code = kind, message, code
        self.param = _bounded(param, MAX_PARAM_CHARS)

    @property
    def http_status(self) -> int:
        return _KINDS[self.kind][0]

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return _KINDS[self.kind][2]

    @property
    def retry_after_s(self) -> int | None:
        """Seconds a client should wait before retrying (overload, engine briefly away)."""
        return RETRY_AFTER_S if self.kind in ("resource_exhausted", "unavailable") else None

    async def abort_grpc(self, context) -> None:
        """End a grpc.aio call with this error; overload answers carry `retry-after`
        trailing metadata, as HTTP 429/503 carry the Retry-After header."""
        trailing = (("retry-after", str(self.retry_after_s)),) if self.retry_after_s else ()
        await context.abort(self.grpc_status, self.message, trailing)

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": _KINDS[self.kind][1],
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_engine(cls, error: "pb.common.Error") -> "ApiError":
        kind = _FROM_ENGINE.get(error.code, "internal")
        return cls(kind, error.message or "the engine failed the request")

    @classmethod
    def from_grpc(cls, err: grpc.aio.AioRpcError, who: str) -> "ApiError":
        kind = _FROM_GRPC.get(err.code(), "internal")
        detail = err.details() or err.code().name
        if kind in ("unavailable", "deadline", "internal"):
            return cls(kind, f"{who} unavailable: {detail}" if kind == "unavailable" else f"{who}: {detail}")
        return cls(kind, detail)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_argument", message, param=param)


async def send_asgi_error(send, err: "ApiError", scope, extra_headers=()) -> None:
    """Answer an ASGI request with `err` in OpenAI's shape, from middleware below the app."""
    import json
    state = scope.get("state")
    if isinstance(state, dict):
        state["outcome"] = f"error:{err.kind}"
    payload = json.dumps(err.to_openai()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": err.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
