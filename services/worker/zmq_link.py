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
