"""API keys for the public HTTP and gRPC APIs.

Keys come from `--api-key` (repeatable), `--api-key-file` (one per line, `#` comments) and
`MESHLLM_API_KEYS` (comma separated); admin keys likewise (`--admin-api-key`,
`--admin-api-key-file`, `MESHLLM_ADMIN_API_KEYS`). A request presents one as
`Authorization: Bearer KEY` (HTTP) or `authorization: Bearer KEY` metadata (gRPC).

- No API key configured: the API is open (the default for `make serve` on 127.0.0.1), even
  when admin keys are configured (they guard the admin routes only).
- Admin routes (`ADMIN_HTTP_PREFIXES`, gRPC methods in `ADMIN_GRPC_METHODS`) need an admin
  key; an admin key also works for ordinary routes. With no admin key configured, admin
  routes are refused (403), never open.
- Comparison is constant-time (hmac.compare_digest of SHA-256 digests, against every key,
  without an early exit). Failures are logged with the route and client, never the key.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable

import grpc

from services.gateway.anthropic import errors as anthropic_errors
from services.gateway.errors import ApiError, send_asgi_error

log = logging.getLogger("meshllm.gateway.auth")

# /metrics: Prometheus scrapes it without a key (it holds counts, never request data).
OPEN_HTTP_PATHS = frozenset({"/health", "/ping", "/metrics"})
ADMIN_HTTP_PREFIXES = ("/admin/", "/profile/", "/drain", "/reset_prefix_cache")
# Anthropic's Messages API (http/messages.py) presents its key as `x-api-key: KEY`.
X_API_KEY_PREFIXES = ("/v1/messages",)
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/meshllm.v1.Status/")
# Changing trace sampling is an admin action on the public port (internal ports are reached
# only by the mesh itself, the profiler among them).
ADMIN_GRPC_METHODS: frozenset[str] = frozenset({"/meshllm.v1.TelemetryControl/SetTraceSampling",
                                                "/meshllm.v1.TelemetryControl/GetTraceSampling",
                                                "/meshllm.v1.Generation/ResetPrefixCache"})

MIN_KEY_CHARS = 8


def read_key_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def collect_keys(flags: Iterable[str] | None, file: str | None, env_var: str,
                 environ: dict[str, str] | None = None) -> list[str]:
    """Keys from flags, a file and an env var, de-duplicated, order kept."""
    env = os.environ if environ is None else environ
    keys = list(flags or [])
    if file:
        try:
            keys += read_key_file(file)
        except OSError as err:
            raise ValueError(f"cannot read the API key file {file!r}: {err.strerror}") from None
    keys += [k.strip() for k in env.get(env_var, "").split(",") if k.strip()]
    for k in keys:
        if len(k) < MIN_KEY_CHARS or any(c.isspace() for c in k):
            raise ValueError(f"API keys must be at least {MIN_KEY_CHARS} characters without "
                             "spaces (a key was rejected; it is not shown)")
    return list(dict.fromkeys(keys))


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), admin_keys: Iterable[str] = ()) -> None:
        self._keys = [_digest(k) for k in keys]
        self._admin = [_digest(k) for k in admin_keys]

    @property
    def enabled(self) -> bool:
        """Whether the ordinary API needs a key: only API keys close it (admin keys alone guard
        the admin routes, docs/security.md)."""
        return bool(self._keys)

    @staticmethod
    def _match(presented: bytes, digests: list[bytes]) -> bool:
        # Same digest length for every key; no early exit, so timing says nothing.
        found = False
        for d in digests:
            found |= hmac.compare_digest(presented, d)
        return found

    def role(self, authorization: str | bytes | None) -> str | None:
        """"admin", "user" or None for an Authorization value ("Bearer KEY")."""
        if not authorization:
            return None
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = _digest(token.strip())
        if self._match(presented, self._admin):
            return "admin"
        if self._match(presented, self._keys):
            return "user"
        return None

    def principal(self, authorization: str | bytes | None) -> tuple[str, bool]:
        """(owner, is_admin) of a caller: the owner is a digest of the key it presented, the
        same for every request made with that key and never the key itself; callers without a
        valid key (only possible when the API is open) share the anonymous owner "". Requests
        are owned by their creator: abort, cancel and retrieval by id check it (an admin key
        may act on any request)."""
        role = self.role(authorization)
        if role is None:
            return "", False
        token = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
        return _digest(token.strip().partition(" ")[2].strip()).hex()[:32], role == "admin"

    def check(self, authorization, admin: bool, where: str, client: str = "-") -> None:
        """Raises ApiError unauthenticated / permission_denied."""
        if not self.enabled and not admin:
            return
        role = self.role(authorization)
        if admin:
            if not self._admin:
                raise ApiError("permission_denied", "admin routes are disabled: start the "
                               "gateway with --admin-api-key")
            if role != "admin":
                log.warning("auth refused route=%s client=%s reason=%s", where, client,
                            "no admin credential")
                raise ApiError("unauthenticated", "a valid admin API key is required")
            return
        if role is None:
            log.warning("auth refused route=%s client=%s reason=%s", where, client,
                        "missing credential" if not authorization else "invalid credential")
            raise ApiError("unauthenticated", "a valid API key is required: send "
                           "'Authorization: Bearer <key>'")


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_HTTP_PREFIXES)


class ApiKeyAuth:
    """Pure ASGI middleware: 401 without a valid key (except OPEN_HTTP_PATHS)."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_HTTP_PATHS:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        admin = is_admin_path(path)
        if not (self.keys.enabled or admin):
            return await self.app(scope, receive, send)
        auth = None
        for k, v in scope.get("headers") or []:
            if k == b"authorization":
                auth = v
                break
            if k == b"x-api-key" and path.startswith(X_API_KEY_PREFIXES):
                auth = b"Bearer " + v   # Anthropic's header; Authorization wins when both come
        client = scope.get("client") or ("-", 0)
        try:
            self.keys.check(auth, admin, f"{scope.get('method')} {path}", f"{client[0]}")
        except ApiError as err:
            challenge = [(b"www-authenticate", b'Bearer realm="meshllm"')] if err.http_status == 401 else []
            if path.startswith(X_API_KEY_PREFIXES):   # the Messages API answers in its shape
                return await anthropic_errors.send_asgi_error(send, err, scope, challenge)
            return await send_asgi_error(send, err, scope, challenge)
        await self.app(scope, receive, send)


def _refusing_handler(handler: grpc.RpcMethodHandler, err: ApiError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `err`."""
    async def unary(request_or_iterator, context):
        await context.abort(err.grpc_status, err.message)

    async def streaming(request_or_iterator, context):
        await context.abort(err.grpc_status, err.message)
        yield  # pragma: no cover  (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class GrpcApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a valid `authorization` metadata value (health, reflection
    and Status stay open)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        method = details.method
        admin = method in ADMIN_GRPC_METHODS
        if method.startswith(OPEN_GRPC_PREFIXES) or not (self.keys.enabled or admin):
            return await continuation(details)
        auth = None
        for k, v in details.invocation_metadata or ():
            if k == "authorization":
                auth = v
                break
        try:
            self.keys.check(auth, admin, f"grpc {method}")
        except ApiError as err:
            handler = await continuation(details)
            return None if handler is None else _refusing_handler(handler, err)
        return await continuation(details)
