"""Free TCP ports that nothing else will grab before the service binds them.

A port from bind(0) comes from the kernel's ephemeral range, which outgoing connections
also draw from: between choosing it and a child process binding it, any client socket may
take it. Ports below that range are never handed out implicitly, so one that is free now
stays free unless someone binds it on purpose.

Nothing holds a chosen port until its service binds it, so one process choosing many (the
launcher: ~25 for a mesh) must never be handed the same port twice, nor one it was told is
taken (the public ports given on its command line): a gRPC server (SO_REUSEPORT by default)
bound to the gateway's HTTP port made the gateway's health answer in HTTP/2."""
from __future__ import annotations

import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768
_handed_out: set[int] = set()   # this process's choices (and reserve()d ports): never again


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def reserve(*ports: int) -> None:
    """Ports chosen elsewhere (0 ignored) that free_port must not hand out in this process."""
    _handed_out.update(p for p in ports if p)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now, outside the ephemeral range (if it can be), and not
    handed out (or reserved) in this process before."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(low, high) if high > low else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            got = s.getsockname()[1]
        _handed_out.add(got)
        return got
    for _ in range(200):   # everything below the range is taken: fall back to the kernel
        with socket.socket() as s:
            s.bind((host, 0))
            got = s.getsockname()[1]
        if got not in _handed_out:
            _handed_out.add(got)
            return got
    raise OSError("no free port that this process has not handed out already")
