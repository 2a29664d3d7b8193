"""Free TCP ports that nothing else will grab before the service binds them.

A port from bind(0) comes from the kernel's ephemeral range, which outgoing connections
also draw from: between choosing it and a child process binding it, any client socket may
take it. Ports below that range are never handed out implicitly, so one that is free now
stays free unless someone binds it on purpose."""
from __future__ import annotations

import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now and outside the ephemeral range (if it can be)."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(low, high) if high > low else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # everything below the range is taken: fall back to the kernel
        s.bind((host, 0))
        return s.getsockname()[1]
