"""A grpc.aio server with grpc.health.v1, reflection and meshllm Status wired in."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc
from grpc_reflection.v1alpha import reflection

from services.common import pb

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class _HealthServicer(hpb_grpc.HealthServicer):
    """grpc.health.v1 answered from a plain dict: no lock, nothing traffic can starve."""

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {"": hpb.HealthCheckResponse.SERVING}
        self._changed = None

    def set(self, service: str, status: int) -> None:
        self.statuses[service] = status
        if self._changed is not None:
            self._changed.set()

    async def Check(self, request, context):
        status = self.statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return hpb.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        import asyncio
        if self._changed is None:
            self._changed = asyncio.Event()
        last = None
        while True:
            status = self.statuses.get(request.service, hpb.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                yield hpb.HealthCheckResponse(status=status)
                last = status
            self._changed.clear()
            await self._changed.wait()


@dataclass
class ServiceHealth:
    """Readiness of one service, shared by grpc.health.v1 and meshllm.v1.Status."""

    service: str
    servicer: _HealthServicer = field(default_factory=_HealthServicer)
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    reason: str = "starting"

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self.ready, self.reason = ready, reason or ("ready" if ready else "not ready")
        status = hpb.HealthCheckResponse.SERVING if ready else hpb.HealthCheckResponse.NOT_SERVING
        # Liveness is "" (always SERVING while the process answers); readiness is per service.
        self.servicer.set("", hpb.HealthCheckResponse.SERVING)
        self.servicer.set(self.service, status)
        self.servicer.set(f"meshllm.{self.service}", status)


class _StatusServicer(pb.health_grpc.StatusServicer):
    def __init__(self, health: ServiceHealth) -> None:
        self._health = health

    async def GetStatus(self, request, context):
        h = self._health
        state = pb.health.SERVING_STATE_READY if h.ready else pb.health.SERVING_STATE_NOT_READY
        return pb.health.ServiceStatus(service=h.service, state=state, reason=h.reason,
                                       uptime_s=time.monotonic() - h.started, version=_version())


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("meshllm")
    except Exception:
        return "dev"


def make_server(service: str, service_names: list[str],
                interceptors=None, reuse_port: bool = False) -> tuple[grpc.aio.Server, ServiceHealth]:
    """Create a server that already serves health, Status and reflection.

    `service_names` are the full names of the servicers the caller will add (for reflection);
    `interceptors` (e.g. the gateway's API-key check) see every call. `reuse_port`: several
    processes may bind the same port (SO_REUSEPORT; off by default so a taken port fails)."""
    from services.common.metrics import GrpcMetricsInterceptor
    # Metrics outermost: calls refused by the others (API keys) are counted with their status.
    from services.common.grpc_tracing import tracing_interceptors
    # Tracing (only when on) inside: a call refused by an API-key check gets no span.
    from services.common.grpc_decode import DecodeGuardInterceptor
    # The decode guard innermost: an undecodable request is INVALID_ARGUMENT before any servicer.
    interceptors = [GrpcMetricsInterceptor(service), *(interceptors or []), *tracing_interceptors(),
                    DecodeGuardInterceptor()]
    options = [o for o in GRPC_OPTIONS if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", int(reuse_port))]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    health = ServiceHealth(service)
    health.servicer.set("", hpb.HealthCheckResponse.SERVING)
    health.servicer.set(service, hpb.HealthCheckResponse.NOT_SERVING)
    hpb_grpc.add_HealthServicer_to_server(health.servicer, server)
    pb.health_grpc.add_StatusServicer_to_server(_StatusServicer(health), server)
    from services.common.telemetry_control import add_telemetry_control
    # Every service can have its trace sampling changed at run time (the profiler fans out).
    control_name = add_telemetry_control(server, service)
    names = [*service_names, "meshllm.v1.Status", control_name, hpb.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health


def bind(server: grpc.aio.Server, address: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind a port (TLS with `credentials`, see services/common/tls.py); returns the port
    (useful with port 0)."""
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise SystemExit(f"cannot bind gRPC address {address}")
    return port


def channel(address: str, options: list[tuple[str, object]] | None = None,
            credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """`options` are added to (and override) GRPC_OPTIONS. `credentials` (internal mTLS, see
    services/common/internal_tls.py): a TLS channel; None: a plain one."""
    opts = GRPC_OPTIONS + list(options or [])
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


async def wait_ready(address: str, service: str, timeout_s: float = 60.0,
                     credentials: grpc.ChannelCredentials | None = None) -> None:
    """Block until `service` on `address` reports SERVING over grpc.health.v1."""
    import asyncio
    deadline = time.monotonic() + timeout_s
    async with channel(address, credentials=credentials) as ch:
        stub = hpb_grpc.HealthStub(ch)
        while True:
            try:
                resp = await stub.Check(hpb.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == hpb.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} at {address} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
