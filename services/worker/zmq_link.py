"""The worker's end of the scheduler link (torch-free, shared by the real and simulated worker)."""
from __future__ import annotations

import zmq

from services.common import pb
from services.common.zmq_curve import CurveServerKeys


class LinkContext(zmq.Context):
    """A context that stops the CURVE ZAP handler (its sockets live in this context) before
    terminating, so `ctx.term()` in the serve loops does not wait on them forever."""

    _authenticator = None

    def term(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        super().term()


def bind_router(ctx: zmq.Context, address: str,
                curve: CurveServerKeys | None = None) -> tuple[zmq.Socket, str]:
    """Bind the ROUTER; `tcp://host:0` picks a free port. Returns the socket and real address.
    With `curve` (enabled) the ROUTER is a CURVE server admitting only the allowed clients;
    `ctx` must then be a LinkContext (it owns the ZAP handler)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None and curve.enabled:
        ctx._authenticator = curve.secure(ctx, sock)  # before bind: the handshake needs it
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def open_endpoints(cfg, log, control=None):
    """Start the worker's gRPC health server and bind its ROUTER (real and simulated worker).

    Returns (server, health, ctx, sock), or None after logging why the ROUTER could not bind.
    Prints the line launchers and tests parse to learn the ports picked for 0."""
    from services.common.grpc_server import bind, make_server
    server, health = make_server("worker", [] if control is None else ["meshllm.v1.WorkerControl"])
    if control is not None:  # WorkerControl (profiling, services/worker/control.py) shares the port
        from services.worker.control import add_to_server
        add_to_server(server, control)
    port = bind(server, f"{cfg.host}:{cfg.grpc_port}", cfg.internal_tls.server_credentials())
    cfg.bound_grpc_addr = f"{cfg.host}:{port}"   # where peers ask for its KV export (kv_export.py)
    await server.start()
    ctx = LinkContext()
    try:
        sock, zmq_addr = bind_router(ctx, cfg.zmq_addr, cfg.zmq_curve)
    except zmq.ZMQError as exc:
        log.error("cannot bind %s: %s", cfg.zmq_addr, exc)
        await server.stop(None)
        return None
    print(f"worker listening grpc={cfg.host}:{port} zmq={zmq_addr}", flush=True)
    from services.common.metrics import start_metrics_server
    metrics_port = start_metrics_server(cfg.host, cfg.metrics_port)
    if metrics_port:
        print(f"worker metrics on http://{cfg.host}:{metrics_port}/metrics", flush=True)
    log.info("serving health on %s:%d, steps on %s (curve %s, internal mTLS %s)", cfg.host, port,
             zmq_addr, "on" if cfg.zmq_curve.enabled else "off",
             "on" if cfg.internal_tls.enabled else "off")
    return server, health, ctx, sock


def error_reply(message: str) -> "pb.step.WorkerReply":
    """The reply to a WorkerRequest that could not be run (bad bytes, bad plan)."""
    reply = pb.step.WorkerReply(result=pb.step.StepResult())
    reply.result.error.code = pb.common.ERROR_CODE_INVALID_ARGUMENT
    reply.result.error.message = message
    return reply
