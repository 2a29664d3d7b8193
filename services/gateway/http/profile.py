"""`POST /profile/start`, `POST /profile/stop`, `GET /profile/status`: the profiler service's
ProfilerControl (control.proto) over HTTP.

These paths are admin routes (auth.py: ADMIN_HTTP_PREFIXES): refused unless the gateway was
started with an admin key and the request presents it. Without `--profiler-addr` they answer
404. A second start while a capture runs is a 409 (ALREADY_EXISTS upstream).

Start body (all optional): {"targets": ["worker0"], "activities": ["cpu", "cuda"],
"max_steps": 200, "max_seconds": 10, "trace_sampling_ratio": 1.0, "record_shapes": false}.
Answers are the CaptureStatus message as JSON (proto field names)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field

import grpc

from services.common import pb
from services.common.profiling import MAX_CAPTURE_SECONDS, MAX_CAPTURE_STEPS
from services.gateway.errors import ApiError
from services.gateway.http.body import read_body
from services.gateway.clients.lazy_stub import LazyStub
from services.gateway.openai.protocol import parse_body

_ACTIVITIES = {"cpu": pb.control.PROFILE_ACTIVITY_CPU, "cuda": pb.control.PROFILE_ACTIVITY_CUDA}
_CALL_TIMEOUT_S = 10.0   # Start fans out to workers and services (2 s limit each) in two rounds


class ProfileStartBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    targets: list[str] = Field(default_factory=list, max_length=256)
    activities: list[str] = Field(default_factory=list, max_length=2)
    max_steps: int = Field(0, ge=0, le=MAX_CAPTURE_STEPS)
    max_seconds: float = Field(0.0, ge=0, le=MAX_CAPTURE_SECONDS, allow_inf_nan=False)
    trace_sampling_ratio: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    record_shapes: bool = False


def _to_json(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _from_grpc(exc: grpc.aio.AioRpcError) -> ApiError:
    code, detail = exc.code(), exc.details() or exc.code().name
    if code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION):
        return ApiError("conflict", detail)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError("invalid_argument", detail)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ApiError("unavailable", f"profiler unavailable: {detail}")
    return ApiError("internal", f"profiler: {detail}")



def add_profile_routes(app: FastAPI, profiler_addr: str, credentials=None, max_body_bytes: int = 65536) -> None:
    client = LazyStub(profiler_addr, credentials, pb.control_grpc.ProfilerControlStub,
                      ("not_found", "profiling is not enabled on this gateway (start it with --profiler-addr)"))

    async def call(method: str, request) -> JSONResponse:
        try:
            reply = await getattr(client.stub(), method)(request, timeout=_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise _from_grpc(exc) from None
        return JSONResponse(_to_json(reply))

    @app.post("/profile/start")
    async def profile_start(request: Request) -> JSONResponse:
        raw = await read_body(request, max_body_bytes)
        body = parse_body(ProfileStartBody, raw) if raw.strip() else ProfileStartBody()
        unknown = [a for a in body.activities if a not in _ACTIVITIES]
        if unknown:
            raise ApiError("invalid_argument", f"activities must be among {sorted(_ACTIVITIES)}, got {unknown}",
                           param="activities")
        req = pb.control.StartCaptureRequest(targets=body.targets,
                                             activities=[_ACTIVITIES[a] for a in body.activities],
                                             record_shapes=body.record_shapes)
        req.bounds.max_steps, req.bounds.max_seconds = body.max_steps, body.max_seconds
        if body.trace_sampling_ratio is not None:
            req.trace_sampling_ratio = body.trace_sampling_ratio
        return await call("Start", req)

    @app.post("/profile/stop")
    async def profile_stop() -> JSONResponse:
        return await call("Stop", pb.control.StopCaptureRequest())

    @app.get("/profile/status")
    async def profile_status() -> JSONResponse:
        return await call("Status", pb.control.CaptureStatusRequest())
