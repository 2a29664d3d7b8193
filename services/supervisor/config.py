"""The supervisor's validated configuration and its spec (what to run)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from google.protobuf import json_format

from services.common import pb
from services.common.internal_tls import InternalTls
from services.supervisor.state import Policy


@dataclass
class SupervisorConfig:
    spec: "pb.supervisor.SupervisorSpec"
    host: str = "127.0.0.1"
    port: int = 50060
    metrics_port: int = 0              # 0: no /metrics listener
    health_interval_s: float = 1.0     # one probe round per replica this often
    health_timeout_s: float = 2.0      # a probe unanswered this long counts as unreachable
    stop_grace_s: float = 30.0         # SIGTERM -> SIGKILL on shutdown
    policy: Policy = field(default_factory=Policy)
    internal_tls: InternalTls = field(default_factory=InternalTls)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in [0, 65535]")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError("--metrics-port must be in [0, 65535]")
        for name in ("health_interval_s", "health_timeout_s", "stop_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        validate_spec(self.spec)


def validate_spec(spec: "pb.supervisor.SupervisorSpec") -> None:
    if not spec.replicas:
        raise ValueError("the spec names no replicas")
    seen: set[str] = set()
    for r in spec.replicas:
        if not r.id or r.id in seen:
            raise ValueError(f"replica ids must be unique and non-empty, got {r.id!r}")
        seen.add(r.id)
        if not r.processes:
            raise ValueError(f"replica {r.id} has no processes")
        for p in r.processes:
            # Only our own services: the spec names a module under services/, never a command.
            if not p.module.isidentifier():
                raise ValueError(f"replica {r.id}: module must be a service name, got {p.module!r}")
            if p.probe in (pb.supervisor.PROBE_GRPC_HEALTH, pb.supervisor.PROBE_TCP) and not p.health_addr:
                raise ValueError(f"replica {r.id}: {p.module} probes without a health_addr")


def load_spec(path: str) -> "pb.supervisor.SupervisorSpec":
    """The JSON form of a SupervisorSpec (protobuf's JSON mapping; unknown fields are errors)."""
    if not os.path.isfile(path):
        raise ValueError(f"--spec {path!r} is not a file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json_format.Parse(text, pb.supervisor.SupervisorSpec())
    except json_format.ParseError as exc:
        raise ValueError(f"--spec {path}: {exc}") from None


def spec_json(spec: "pb.supervisor.SupervisorSpec") -> str:
    return json_format.MessageToJson(spec)
