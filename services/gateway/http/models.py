"""`GET /health`, `GET /metrics`, `GET /v1/models[/{model}]` and `POST /v1/embeddings`."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.http.body import read_body
from services.gateway.http.metrics import metrics_route, track_inflight
from services.gateway.service import Gateway


def add_model_routes(app: FastAPI, gw: Gateway) -> None:
    started = int(time.time())
    # Prometheus scrapes; open like /health (guard/auth.OPEN_HTTP_PATHS), see docs/metrics.md.
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
