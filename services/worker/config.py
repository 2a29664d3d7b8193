"""The worker's one validated configuration (flags are read only in main.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
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
    num_kv_blocks: int = 0             # 0: size the cache from kv_cache_memory_gb
    block_size: int = 16               # initial block size; WorkerHello may change it
    served_model_name: str = ""        # "": the model directory's name
    num_threads: int = 0               # 0: every core this process may run on
    enforce_eager: bool = False        # CUDA: no CUDA graphs for decode steps
    log_every_s: float = 10.0
    simulate: bool = False             # no model: services/worker/simulated.py
    simulate_step_ms: float = 0.0      # simulated time per step ...
    simulate_token_ms: float = 0.0     # ... plus per scheduled token

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model!r} is not a model directory (no config.json)")
        if not self.zmq_addr.startswith(ZMQ_SCHEMES):
            raise ValueError(f"--zmq-addr must start with one of {ZMQ_SCHEMES}, got {self.zmq_addr!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
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
        if not self.served_model_name:
            self.served_model_name = os.path.basename(os.path.normpath(self.model))

    @property
    def torch_dtype(self):
        import torch
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_memory_gb * 2**30)

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
