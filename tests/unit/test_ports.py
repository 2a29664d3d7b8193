"""free_port (services/common/ports.py): a process choosing many ports for its services never gets
one twice, nor one reserved for something else (the launcher's public ports), and each is free
when handed out."""
from __future__ import annotations

import socket

from services.common import ports


def test_a_process_never_hands_out_a_port_twice_or_a_reserved_one(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1124)    # candidates: 1024 .. 1123
    reserved = set(range(1024, 1084))
    ports.reserve(*reserved, 0)
    got = [ports.free_port() for _ in range(30)]
    assert len(set(got)) == len(got), "a port handed out twice"
    assert not reserved & set(got) and 0 not in got
    assert sum(1084 <= p < 1124 for p in got) >= 20, "the candidates below the ephemeral range come first"
    for p in got[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))        # free: nothing else bound it meanwhile
