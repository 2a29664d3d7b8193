"""`GET /tokenizer_info` (vLLM's shape): the tokenizer's configuration, i.e. tokenizer_config.json
without local file paths, with `tokenizer_class` and the `chat_template` in use. It is behind the
API keys like every route, and off unless --enable-tokenizer-info-endpoint (as vLLM: a custom
--chat-template would be shown to every key holder); off, the route answers 404."""
from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.gateway.errors import ApiError
from services.gateway.service import Gateway


def add_tokenizer_info_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        if not gw.config.enable_tokenizer_info_endpoint:
            raise ApiError("not_found", "GET /tokenizer_info is off: start the gateway with "
                                        "--enable-tokenizer-info-endpoint")
        cfg = await gw.tokenizer.get_config()
        out = json.loads(cfg.config_json) if cfg.config_json else {}
        out["tokenizer_class"] = cfg.tokenizer_class
        if cfg.chat_template:
            out["chat_template"] = cfg.chat_template
        return JSONResponse(out)
