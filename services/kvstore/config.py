"""The kvstore's one validated config (filled from flags in main.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.common.internal_tls import InternalTls

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class KvStoreConfig:
    host: str = "127.0.0.1"
    port: int = 50070                   # 0 = any free port
    capacity_gb: float = 1.0            # host memory for blocks (hard bound; the LRU evicts)
    disk_dir: str = ""                  # spill evicted blocks here ("" = no disk tier)
    disk_gb: float = 0.0                # hard bound of the disk tier (required with disk_dir)
    backend: str = "memory"             # "memory" or redis://HOST:PORT[/DB]
    zero_copy: bool = True              # same-host clients map the memory backend's blocks (in place)
    nixl: bool | None = None            # the blocks over NIXL for clients that cannot map them
                                        # (None: on with the memory backend when nixl imports)
    shm_window_mb: int = 64             # one client's window (the Redis backend's same-host plane)
    shm_windows: int = 16               # windows (0 = none)
    verify_on_commit: str = "async"     # a zero-copy Commit's check: after it answers, or before (verifier.py)
    verify_threads: int = 4             # the async check's own threads (0: the copy threads)
    lease_ttl_s: float = 30.0           # a lease unused this long ends: its pins and slots are freed
    worker_threads: int = 4             # calls' work (disk, Redis) off the event loop
    copy_threads: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))  # one call's blocks in parallel
    internal_tls: InternalTls = field(default_factory=InternalTls)
    metrics_port: int = 0
    log_level: str | None = None

    def __post_init__(self) -> None:
        from services.common.metrics import check_metrics_config
        check_metrics_config(self.metrics_port)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} out of range")
        if self.capacity_gb <= 0:
            raise ValueError(f"--capacity-gb must be positive, got {self.capacity_gb}")
        if self.backend != "memory" and not self.backend.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--backend must be 'memory' or redis://HOST:PORT, got {self.backend!r}")
        if self.nixl and self.backend != "memory":
            raise ValueError("--nixl offers the memory backend's block memory: it does not go with a Redis backend")
        if self.disk_dir:
            if self.backend != "memory":
                raise ValueError("--disk-dir spills host memory: it does not go with a Redis backend")
            if self.disk_gb <= 0:
                raise ValueError("--disk-dir needs --disk-gb (the disk tier's bound), > 0")
            parent = os.path.dirname(os.path.abspath(self.disk_dir))
            if not os.path.isdir(parent):
                raise ValueError(f"--disk-dir {self.disk_dir!r}: {parent} does not exist")
        elif self.disk_gb:
            raise ValueError("--disk-gb needs --disk-dir")
        if self.verify_on_commit not in ("sync", "async"):
            raise ValueError(f"--verify-on-commit must be sync or async, got {self.verify_on_commit!r}")
        if self.shm_window_mb <= 0 or self.shm_windows < 0:
            raise ValueError("--shm-window-mb must be positive and --shm-windows >= 0")
        if self.verify_threads < 0:
            raise ValueError("--verify-threads must be >= 0")
        if self.lease_ttl_s <= 0 or self.worker_threads <= 0 or self.copy_threads <= 0:
            raise ValueError("--lease-ttl-s, --worker-threads and --copy-threads must be positive")

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GIB)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gb * GIB)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
