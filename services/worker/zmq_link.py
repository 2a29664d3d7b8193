"""The worker's end of the scheduler link (torch-free, shared by the real and simulated worker)."""
from __future__ import annotations

import zmq


def bind_router(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, str]:
    """Bind the ROUTER; `tcp://host:0` picks a free port. Returns the socket and real address."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def open_endpoints(cfg, log):
    """Start the worker's gRPC health server and bind its ROUTER (real and simulated worker).

    Returns (server, health, ctx, sock), or None after logging why the ROUTER could not bind.
    Prints the line launchers and tests parse to learn the ports picked for 0."""
    from services.common.grpc_server import bind, make_server
    server, health = make_server("worker", [])
    port = bind(server, f"{cfg.host}:{cfg.grpc_port}")
    await server.start()
    ctx = zmq.Context()
    try:
        sock, zmq_addr = bind_router(ctx, cfg.zmq_addr)
    except zmq.ZMQError as exc:
        log.error("cannot bind %s: %s", cfg.zmq_addr, exc)
        await server.stop(None)
        return None
    print(f"worker listening grpc={cfg.host}:{port} zmq={zmq_addr}", flush=True)
    log.info("serving health on %s:%d, steps on %s", cfg.host, port, zmq_addr)
    return server, health, ctx, sock
