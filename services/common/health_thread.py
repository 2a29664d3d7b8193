"""grpc.health.v1 on its own port, answered by threads the service's event loop never blocks.

A service's main grpc.aio server shares one event loop with its real work (the scheduler's
engine loop, thousands of stream messages a second): under heavy traffic, or when that loop
is stuck, a health check queued behind the work says nothing true in time. This server runs
on gRPC's own threads with a small thread pool of its own, and calls `verdict()` on every
check, so the answer reflects the service's state now (e.g. "work pending and no step
completed for 30 s") even while the loop is saturated or wedged. `verdict()` must only read
plain attributes (no locks the loop may hold, no awaiting).

Liveness is the service "" (SERVING while the process answers); readiness is every name in
`services` (SERVING only when `verdict()` says ready)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb

log = logging.getLogger("meshllm.health")

Verdict = Callable[[], tuple[bool, str]]   # () -> (ready, reason)


class _Servicer(hpb_grpc.HealthServicer):
    def __init__(self, services: set[str], verdict: Verdict) -> None:
        self._services, self._verdict = services, verdict

    def _status(self, service: str) -> int | None:
        if service == "":
            return hpb.HealthCheckResponse.SERVING
        if service not in self._services:
            return None
        ready, _ = self._verdict()
        return hpb.HealthCheckResponse.SERVING if ready else hpb.HealthCheckResponse.NOT_SERVING

    def Check(self, request, context):
        status = self._status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return hpb.HealthCheckResponse(status=status)

    # No Watch: a stream would hold one of the few threads for good (use the main port's).


class _Status(pb.health_grpc.StatusServicer):
    """meshllm.v1.Status with the verdict's reason, so a supervisor can say why."""

    def __init__(self, service: str, verdict: Verdict) -> None:
        self._service, self._verdict, self._started = service, verdict, time.monotonic()

    def GetStatus(self, request, context):
        ready, reason = self._verdict()
        return pb.health.ServiceStatus(
            service=self._service, reason=reason, uptime_s=time.monotonic() - self._started,
            state=pb.health.SERVING_STATE_READY if ready else pb.health.SERVING_STATE_NOT_READY)


def start_health_server(host: str, port: int, services: list[str], verdict: Verdict,
                        credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int]:
    """Serve grpc.health.v1 on host:port (0: any free port) from threads; returns the server
    (stop it with .stop(grace)) and the bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health"),
                         options=[("grpc.so_reuseport", 0)])
    hpb_grpc.add_HealthServicer_to_server(_Servicer(set(services), verdict), server)
    pb.health_grpc.add_StatusServicer_to_server(_Status(services[0], verdict), server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, credentials) if credentials is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise SystemExit(f"cannot bind the health address {address}")
    server.start()
    log.info("health (own thread) on %s:%d", host, bound)
    return server, bound
