"""The worker's one validated configuration (flags are read only in main.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.common.internal_tls import InternalTls
from services.common.zmq_curve import CurveServerKeys

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --kv-cache-dtype names: auto = the model's dtype; fp8 = fp8_e4m3 (torch.float8_e4m3fn,
# per-tensor scales 1.0). fp8_e5m2 is not offered: the kernels store e4m3 only.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
OVERLAP_MODES = ("auto", "on", "off")
# --quantization: none, or fp8 = e4m3 projections with per-output-channel scales (models/fp8.py).
QUANTIZATIONS = ("none", "fp8")
DEVICES = ("cpu", "cuda")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class WorkerConfig:
    model: str
    zmq_addr: str
    host: str = "127.0.0.1"
    grpc_port: int = 0                 # 0: pick a free port and print it
    device: str = "cpu"                # "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"                # auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int = 0             # 0: the model's max_position_embeddings
    kv_cache_memory_gb: float = 1.0
    kv_cache_dtype: str = "auto"       # KV_CACHE_DTYPES; fp8 halves the bytes per block
    quantization: str = "none"         # QUANTIZATIONS: "fp8" = per-channel FP8 projections (models/fp8.py)
    speculative_config: str = ""       # --speculative-config JSON ("": off); spec/decoder.py
    num_kv_blocks: int = 0             # 0: size the cache from kv_cache_memory_gb
    block_size: int = 16               # initial block size; WorkerHello may change it
    served_model_name: str = ""        # "": the model directory's name
    num_threads: int = 0               # 0: every core this process may run on
    enforce_eager: bool = False        # CUDA: no CUDA graphs for decode steps
    overlap_steps: str = "auto"        # OVERLAP_MODES: submit step N+1 before collecting N (runner.py)
    log_every_s: float = 10.0
    simulate: bool = False             # no model: services/worker/simulated.py
    simulate_step_ms: float = 0.0      # simulated time per step ...
    simulate_token_ms: float = 0.0     # ... plus per scheduled token
    profile_dir: str = ""              # root of profiler traces (WorkerControl); "": refused
    internal_tls: InternalTls = field(default_factory=InternalTls)      # mTLS on the health port
    zmq_curve: CurveServerKeys = field(default_factory=CurveServerKeys)  # CURVE on the ROUTER
    tensor_parallel_size: int = 1      # ranks (processes) of this worker; rank r uses cuda:K+r
    tp_rank: int = 0                   # set by rank 0 for the ranks it starts (tp_ranks.py)
    tp_init_method: str = ""           # torch.distributed rendezvous, set by rank 0 likewise
    engine_id: str = "0"               # the `engine` label of this worker's metrics
    metrics_port: int = 0              # Prometheus /metrics on host:metrics_port; 0 = off
    kvstore_addr: str = ""             # tier 2, the kvstore (docs/kv_tiers.md): fetch and save blocks there
    kv_offload_gb: float = 0.0         # tier 1: host memory for blocks the device cache evicts (0: off)
    kv_load_timeout_ms: float = 2000.0 # a kvstore fetch not done by then is cut short (recomputed)
    kv_save_buffer_mb: float = 256.0   # host buffers of saves in flight (past them saves are dropped)
    kv_export: bool = False            # direct hand-offs (docs/pd.md): a KV cache peers can map, and map theirs
    kv_direct_transport: str = "mmap"  # kv_export.TRANSPORTS: mmap/CUDA IPC on one host; nixl; auto (both)
    bound_grpc_addr: str = ""          # set once the gRPC port is bound (its WorkerControl: ExportKv)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model!r} is not a model directory (no config.json)")
        if not self.zmq_addr.startswith(ZMQ_SCHEMES):
            raise ValueError(f"--zmq-addr must start with one of {ZMQ_SCHEMES}, got {self.zmq_addr!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.overlap_steps not in OVERLAP_MODES:
            raise ValueError(f"--overlap-steps must be one of {OVERLAP_MODES}, got {self.overlap_steps!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        from services.common.spec_config import check_served
        check_served(self.speculative_config, self.tensor_parallel_size, self.model)
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be in [0, 65535], got {self.grpc_port}")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be >= 0")
        if self.num_kv_blocks < 0:
            raise ValueError("--num-kv-blocks must be >= 0")
        if not self.num_kv_blocks and not self.kv_cache_memory_gb > 0:
            raise ValueError("--kv-cache-memory-gb must be > 0")
        if not 1 <= self.block_size <= 1024:
            raise ValueError("--block-size must be in [1, 1024]")
        if self.num_threads < 0:
            raise ValueError("--num-threads must be >= 0")
        if self.simulate_step_ms < 0 or self.simulate_token_ms < 0:
            raise ValueError("--simulate-step-ms and --simulate-token-ms must be >= 0")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"--tensor-parallel-size must be in [1, 64], got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            if self.simulate:
                raise ValueError("--tensor-parallel-size applies to the real worker, not --simulate")
            if self.device.startswith("cuda:") and not self.device[5:].isdigit():
                raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 <= self.tp_rank < self.tensor_parallel_size:
            raise ValueError(f"tp rank {self.tp_rank} outside [0, {self.tensor_parallel_size})")
        if self.tp_rank and not self.tp_init_method.startswith("tcp://"):
            raise ValueError("a tensor-parallel rank > 0 needs a tcp:// init method")
        from services.common.metrics import check_metrics_config
        check_metrics_config(self.metrics_port, self.engine_id)
        from services.common.kv_blocks import check_kvstore_addr
        check_kvstore_addr(self.kvstore_addr)
        if self.kv_direct_transport not in ("auto", "mmap", "nixl"):
            raise ValueError("--kv-direct-transport must be auto, mmap or nixl")
        if self.kv_offload_gb < 0 or self.kv_load_timeout_ms <= 0 or self.kv_save_buffer_mb <= 0:
            raise ValueError("--kv-offload-gb must be >= 0, --kv-load-timeout-ms and --kv-save-buffer-mb > 0")
        if not self.served_model_name:
            self.served_model_name = os.path.basename(os.path.normpath(self.model))

    @property
    def torch_dtype(self):
        import torch
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self):
        """Storage dtype of the KV cache; None: the model's dtype (ModelRunner's default)."""
        if self.kv_cache_dtype == "auto":
            return None
        import torch
        return torch.float8_e4m3fn

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_memory_gb * 2**30)

    @property
    def threads(self) -> int:
        # CPU ranks of one worker share the cores instead of each spinning on all of them.
        return self.num_threads or max(1, len(os.sched_getaffinity(0)) // self.tensor_parallel_size)

    @property
    def first_gpu(self) -> int:
        """K of --device cuda:K (0 for plain cuda): tensor-parallel rank r runs on cuda:K+r."""
        return int(self.device[5:]) if self.device.startswith("cuda:") else 0

    @property
    def rank_device(self) -> str:
        """This rank's device: rank r of a tensor-parallel CUDA worker runs on cuda:(K + r)."""
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda"):
            return f"cuda:{self.first_gpu + self.tp_rank}"
        return self.device
