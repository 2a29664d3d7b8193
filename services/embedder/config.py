"""The embedder's one validated config (flags are read only in main.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.common.internal_tls import InternalTls

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EmbedderConfig:
    model: str                          # HF-format BERT dir (config.json, model.safetensors, tokenizer.json)
    host: str = "127.0.0.1"
    port: int = 50055                   # gRPC meshllm.v1.Embedder + health; 0 = any free port
    device: str = "cpu"                 # "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"                 # auto: float32 on CPU, float16 on CUDA
    served_model_name: str = ""         # "": the model directory's name
    max_model_len: int = 0              # 0: the model's max_position_embeddings (512 for MiniLM)
    max_items_per_request: int = 2048   # OpenAI's limit on inputs per embeddings request
    max_request_chars: int = 16_000_000  # text chars per request (tokenization is not free)
    max_batch_items: int = 64           # items in one forward pass
    max_batch_tokens: int = 8192        # padded tokens in one forward pass (bounds activations)
    batch_wait_ms: float = 5.0          # how long an idle embedder waits for items to batch
    max_queued_items: int = 65536       # items waiting for the model; beyond: RESOURCE_EXHAUSTED
    num_threads: int = 0                # torch intra-op threads; 0: every core we may run on
    log_level: str | None = None
    internal_tls: InternalTls = field(default_factory=InternalTls)  # mTLS on our gRPC port
    metrics_port: int = 0               # Prometheus /metrics on host:metrics_port; 0 = off

    def __post_init__(self) -> None:
        from services.common.metrics import check_metrics_config
        check_metrics_config(self.metrics_port)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model!r} is not a model directory (no config.json)")
        if not os.path.isfile(os.path.join(self.model, "tokenizer.json")):
            raise ValueError(f"--model {self.model!r} has no tokenizer.json")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must be >= 0")
        for name in ("max_items_per_request", "max_request_chars", "max_batch_items",
                     "max_batch_tokens", "max_queued_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_queued_items < self.max_items_per_request:
            raise ValueError("--max-queued-items must be at least --max-items-per-request")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError("--batch-wait-ms must be in [0, 1000]")
        if self.num_threads < 0:
            raise ValueError("--num-threads must be >= 0")
        if not self.served_model_name:
            self.served_model_name = os.path.basename(os.path.normpath(self.model))

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def torch_dtype(self):
        import torch
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.float16
        return getattr(torch, self.dtype)

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
