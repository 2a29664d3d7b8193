"""How the HTTP API answers errors: OpenAI's error body with the ApiError's status."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.errors import ApiError

log = logging.getLogger("meshllm.gateway.http")


def install_error_handlers(app: FastAPI) -> None:
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
