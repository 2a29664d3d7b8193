"""Admin routes for operating the engines: `POST /reset_prefix_cache` and `POST /drain`.

Both are admin routes (auth.py: ADMIN_HTTP_PREFIXES): refused unless the gateway was started
with an admin key and the request presents it.

- `POST /reset_prefix_cache` (vLLM's route of the same name) asks every engine
  replica to drop the prefix-cache entries of the KV blocks no request holds
  (Engine.ResetPrefixCache, run between steps; running requests keep theirs). 200 with one
  outcome per replica when every asked replica flushed; 503 with the same body plus an
  `error` when none could be asked or one failed (the others are flushed all the same).
  With the body `{"tiers": true}` the KV tiers go too (docs/kv_tiers.md): each engine's host
  pool index and its namespace in the kvstore (`num_tier_blocks_flushed`).
- `POST /drain` with `{"replica": "engine-1"}` marks the replica DRAINING in the supervisor
  (it finishes what it runs; routers send it nothing new); `{"replica": "engine-1",
  "undrain": true}` puts it back. Answers the supervisor's Replica as JSON. 404 for an
  unknown replica; 409 when the gateway follows no supervisor (--supervisor-addr)."""
from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field

from services.common import pb
from services.gateway.clients.engine_pool import EnginePool, reset_prefix_caches
from services.gateway.errors import ApiError
from services.gateway.http.body import read_body
from services.gateway.clients.lazy_stub import LazyStub
from services.gateway.openai.protocol import parse_body

_DRAIN_TIMEOUT_S = 10.0


class ResetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tiers: bool = False


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replica: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    undrain: bool = False


def _from_supervisor(exc: grpc.aio.AioRpcError) -> ApiError:
    code, detail = exc.code(), exc.details() or exc.code().name
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError("not_found", detail, param="replica")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError("invalid_argument", detail, param="replica")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ApiError("conflict", detail)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ApiError("unavailable", f"supervisor unavailable: {detail}")
    return ApiError("internal", f"supervisor: {detail}")



def add_admin_routes(app: FastAPI, engines: EnginePool, supervisor_addr: str, credentials=None,
                     max_body_bytes: int = 65536) -> None:
    supervisor = LazyStub(supervisor_addr, credentials, pb.supervisor_grpc.SupervisorStub,
                          ("conflict", "this gateway follows no supervisor, so it cannot drain replicas: "
                           "start it with --supervisor-addr (meshllm serve does)"))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        raw = await read_body(request, max_body_bytes)
        body = parse_body(ResetBody, raw) if raw.strip() else ResetBody()
        report, failure = await reset_prefix_caches(engines, body.tiers)
        body = {"object": "prefix_cache_reset", **report}
        if failure:
            body.update(ApiError("unavailable", failure).to_openai())
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    @app.post("/drain")
    async def drain(request: Request) -> JSONResponse:
        raw = await read_body(request, max_body_bytes)
        if not raw.strip():
            raise ApiError("invalid_argument", 'send {"replica": "<id>"} (and "undrain": true to '
                           "undo); replica ids are in the supervisor's ListReplicas, e.g. engine-0",
                           param="replica")
        body = parse_body(DrainBody, raw)
        stub = supervisor.stub()
        call = stub.Undrain if body.undrain else stub.Drain
        try:
            replica = await call(pb.supervisor.DrainRequest(replica_id=body.replica), timeout=_DRAIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise _from_supervisor(exc) from None
        return JSONResponse(json_format.MessageToDict(replica, preserving_proto_field_name=True,
                                                      always_print_fields_with_no_presence=True))
