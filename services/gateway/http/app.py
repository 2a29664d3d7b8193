"""The OpenAI-compatible HTTP API (FastAPI), served by uvicorn on the gateway's loop: one
route module per family of routes, composed here."""
from __future__ import annotations

from fastapi import FastAPI

from services.gateway.http.admin import add_admin_routes
from services.gateway.http.completions import add_completion_routes
from services.gateway.http.errors import install_error_handlers
from services.gateway.http.invocations import add_invocation_routes
from services.gateway.http.messages import add_message_routes
from services.gateway.http.models import add_model_routes
from services.gateway.http.openapi import install as install_openapi
from services.gateway.http.profile import add_profile_routes
from services.gateway.http.responses import add_responses_routes
from services.gateway.http.tokenize import add_tokenize_routes
from services.gateway.http.tokenizer_info import add_tokenizer_info_routes
from services.gateway.service import Gateway


def create_app(gw: Gateway) -> FastAPI:
    # GET /openapi.json with the request-body schemas the raw-body routes validate against.
    app = FastAPI(title="meshllm gateway", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    install_error_handlers(app)
    add_model_routes(app, gw)
    add_completion_routes(app, gw)
    add_message_routes(app, gw)
    add_responses_routes(app, gw)
    add_tokenize_routes(app, gw)
    add_tokenizer_info_routes(app, gw)
    add_invocation_routes(app, gw)
    cfg = gw.config
    credentials = cfg.internal_tls.channel_credentials()
    add_profile_routes(app, cfg.profiler_addr, credentials, cfg.max_body_bytes)
    add_admin_routes(app, gw.engine, cfg.supervisor_addr, credentials, cfg.max_body_bytes)
    return app
