"""The scheduler service's validated configuration."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerServiceConfig:
    worker_addr: str
    host: str = "127.0.0.1"
    port: int = 50053
    max_model_len: int = 0            # 0: the worker's (the model's) context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    max_waiting: int = 65536
    step_timeout_s: float = 120.0
    served_model_name: str = ""
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if not self.worker_addr.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--worker-addr must be tcp://HOST:PORT or ipc://PATH, got {self.worker_addr!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in [0, 65535]")
