"""TelemetryControl (control.proto): read or change this process's trace sampling ratio.

Every service serves it: `make_server` calls `add_telemetry_control` on each gRPC server it
builds, so a new service gets it for free. The profiler service fans SetTraceSampling out to
every service. The ratio is process-wide (services/common/telemetry.py); the sampler is
parent-based, so the root service (the gateway) decides which new requests are traced and
the others follow the caller's decision. On the gateway's public port these methods need
an admin key (services/gateway/guard/auth.py: ADMIN_GRPC_METHODS).
"""
from __future__ import annotations

import logging

import grpc

from services.common import pb, telemetry

log = logging.getLogger("meshllm.telemetry")

SERVICE_NAME = "meshllm.v1.TelemetryControl"
METHODS = (f"/{SERVICE_NAME}/SetTraceSampling", f"/{SERVICE_NAME}/GetTraceSampling")


class TelemetryControlServicer(pb.control_grpc.TelemetryControlServicer):
    def __init__(self, service: str) -> None:
        self._service = service

    def _answer(self, previous: float) -> pb.control.TraceSampling:
        return pb.control.TraceSampling(service=self._service, ratio=telemetry.get_trace_sampling_ratio(),
                                        previous_ratio=previous, tracing_enabled=telemetry.ENABLED)

    async def SetTraceSampling(self, request, context):
        try:
            previous = telemetry.set_trace_sampling_ratio(request.ratio)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("trace sampling ratio %.4g -> %.4g", previous, request.ratio)
        return self._answer(previous)

    async def GetTraceSampling(self, request, context):
        ratio = telemetry.get_trace_sampling_ratio()
        return self._answer(ratio)


def add_telemetry_control(server: grpc.aio.Server, service: str) -> str:
    """Serve TelemetryControl on `server`; returns the full service name (for reflection)."""
    pb.control_grpc.add_TelemetryControlServicer_to_server(TelemetryControlServicer(service), server)
    return SERVICE_NAME
