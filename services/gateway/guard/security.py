"""The gateway's security wiring, kept out of main.py: the ASGI middleware stack of the HTTP
app, the gRPC interceptors, and SIGHUP reload (the flags that configure it: gateway/flags.py)."""
from __future__ import annotations

import asyncio
import logging
import signal

from services.common.tls import ServerTls
from services.gateway.guard.auth import ADMIN_GRPC_METHODS, ApiKeyAuth, ApiKeys, GrpcApiKeyInterceptor
from services.gateway.guard.body_guard import BodyGuard

log = logging.getLogger("meshllm.gateway.security")

class Security:
    def __init__(self, config) -> None:
        self.config = config
        self.keys = ApiKeys(config.api_keys, config.admin_api_keys)
        self.tls = ServerTls(config.tls) if config.tls.enabled else None

    def grpc_interceptors(self) -> list | None:
        # Installed only when there is something to check (keys, or admin methods, which are
        # refused without an admin key): an open API pays no per-call interceptor cost.
        if self.keys.enabled or ADMIN_GRPC_METHODS:
            return [GrpcApiKeyInterceptor(self.keys)]
        return None

    def grpc_credentials(self):
        return self.tls.grpc_credentials() if self.tls else None

    def wrap_http(self, app):
        """RequestContext(app) -> auth -> bounded body -> routes (auth first, so nobody
        unauthenticated can make the gateway read or decompress a body)."""
        inner = BodyGuard(app.app, self.config.max_body_bytes, self.config.max_compression_ratio)
        app.app = ApiKeyAuth(inner, self.keys)
        return app

    def uvicorn_kwargs(self) -> dict:
        if self.tls is None:
            return {}
        ctx = self.tls.ssl_context  # ours (not one uvicorn builds), so SIGHUP can reload it
        return {"ssl_context_factory": lambda config, default_factory: ctx}

    def install_reload(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.tls is not None:
            loop.add_signal_handler(signal.SIGHUP, self.tls.reload)

    def describe(self) -> str:
        return (f"tls={'on' if self.tls else 'off'} "
                f"client_auth={self.config.tls.client_auth} "
                f"api_keys={len(self.config.api_keys)} "
                f"admin_keys={len(self.config.admin_api_keys)}")
