"""The scheduler service's validated configuration."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.internal_tls import InternalTls
from services.common.zmq_curve import CurveClientKeys


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
    internal_tls: InternalTls = field(default_factory=InternalTls)    # mTLS on our gRPC port
    zmq_curve: CurveClientKeys = field(default_factory=CurveClientKeys)  # CURVE to the worker
    engine_id: str = "0"              # the `engine` label of this engine's metrics
    metrics_port: int = 0             # Prometheus /metrics on host:metrics_port; 0 = off
    health_port: int = 0              # grpc.health.v1 on its own thread (health_thread.py); 0 = off
    progress_timeout_s: float = 30.0  # work pending and no step completed this long: NOT_SERVING
    shutdown_grace_s: float = 20.0    # SIGTERM: in-flight requests get this long, then fail
    kvstore_addr: str = ""            # the secondary KV tier (docs/kv_tiers.md): lookups go there
    speculative_config: str = ""      # --speculative-config JSON ("": off); budgets draft tokens
    num_spec_tokens: int = 0          # from it: the most draft tokens per decode step
    kv_role: str = ""                 # "prefill" / "decode" / "" both (docs/pd.md): in EngineInfo
    kv_load_failure_policy: str = "recompute"   # a hand-off's KV missing: recompute or fail
    kv_lease_s: float = 30.0          # direct hand-offs: blocks held for the decode side at most this long

    def __post_init__(self) -> None:
        from services.common.spec_config import parse_spec_config
        spec = parse_spec_config(self.speculative_config)     # SpecConfigError (a ValueError) names the field
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
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
        if not 0 <= self.health_port < 65536:
            raise ValueError("--health-port must be in [0, 65535]")
        if self.progress_timeout_s <= 0 or self.shutdown_grace_s < 0:
            raise ValueError("--progress-timeout-s must be positive and --shutdown-grace-s >= 0")
        from services.common.metrics import check_metrics_config
        check_metrics_config(self.metrics_port, self.engine_id)
        from services.common.kv_blocks import check_kvstore_addr
        check_kvstore_addr(self.kvstore_addr)
        if self.kv_role not in ("", "prefill", "decode"):
            raise ValueError(f"--kv-role must be prefill, decode or empty, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("--kv-load-failure-policy must be recompute or fail")
        if self.kv_lease_s <= 0:
            raise ValueError("--kv-lease-s must be positive")
