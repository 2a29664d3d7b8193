"""The profiler service's one validated config (flags and env are read only in main.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.internal_tls import InternalTls
from services.common.metrics import check_metrics_config


def parse_target(spec: str, default_name: str) -> tuple[str, str]:
    """"NAME=HOST:PORT" or "HOST:PORT" (named `default_name`) -> (name, address)."""
    name, sep, addr = spec.partition("=")
    if not sep:
        name, addr = default_name, spec
    name, addr = name.strip(), addr.strip()
    if not name or not addr or ":" not in addr:
        raise ValueError(f"a target must be NAME=HOST:PORT or HOST:PORT, got {spec!r}")
    return name, addr


@dataclass
class ProfilerConfig:
    artifact_dir: str                                          # traces go to artifact_dir/<capture id>/
    host: str = "127.0.0.1"
    port: int = 0                                              # 0: a free port (printed)
    workers: list[tuple[str, str]] = field(default_factory=list)    # (name, WorkerControl address)
    services: list[tuple[str, str]] = field(default_factory=list)   # (name, TelemetryControl address)
    gateway_addr: str = ""            # the gateway's public gRPC port (TelemetryControl, admin key)
    control_api_key: str = ""         # presented to the gateway as 'authorization: Bearer KEY'
    rpc_timeout_s: float = 2.0        # Start / Status fan-out to one worker or service
    stop_timeout_s: float = 0.5       # Stop fan-out: Stop must answer in well under a second
    poll_interval_s: float = 0.25     # how often a running capture asks its workers for status
    write_timeout_s: float = 120.0    # after a capture ends, how long its traces may take to write
    internal_tls: InternalTls = field(default_factory=InternalTls)
    metrics_port: int = 0             # Prometheus /metrics (gRPC request counters); 0: off
    log_level: str | None = None

    def __post_init__(self) -> None:
        if not self.artifact_dir:
            raise ValueError("--artifact-dir must be set")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        check_metrics_config(self.metrics_port)
        for kind, targets in (("--worker", self.workers), ("--service", self.services)):
            names = [n for n, _ in targets]
            if len(set(names)) != len(names):
                raise ValueError(f"{kind} names must be unique, got {names}")
        if self.gateway_addr and ":" not in self.gateway_addr:
            raise ValueError(f"--gateway-addr must be HOST:PORT, got {self.gateway_addr!r}")
        for name in ("rpc_timeout_s", "stop_timeout_s", "poll_interval_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.stop_timeout_s >= 1.0:
            raise ValueError("--stop-timeout-s must be under 1 s (Stop answers in under a second)")
