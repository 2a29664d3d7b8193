"""The tokenizer service's one validated config (filled from flags in main.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.internal_tls import InternalTls


@dataclass
class TokenizerConfig:
    model: str                          # HF-format model dir (tokenizer.json, ...)
    host: str = "127.0.0.1"
    port: int = 50052                   # 0 = any free port
    chat_template: str | None = None    # file overriding the model's chat template
    max_batch_texts: int = 1024         # texts per Encode call
    max_text_chars: int = 4_000_000     # chars per text
    max_total_chars: int = 16_000_000   # chars per Encode call (messages are <= 64 MiB)
    max_chat_messages: int = 4096
    max_template_chars: int = 1_000_000  # chat messages in, rendered prompt out
    max_render_s: float = 2.0
    max_detokenize_requests: int = 65536  # unfinished requests per Detokenize stream
    worker_threads: int = 2             # encode/render off the event loop
    internal_tls: InternalTls = field(default_factory=InternalTls)  # mTLS on our gRPC port
    metrics_port: int = 0               # Prometheus /metrics on host:metrics_port; 0 = off

    def __post_init__(self) -> None:
        from services.common.metrics import check_metrics_config
        check_metrics_config(self.metrics_port)
        model = Path(self.model)
        if not (model / "tokenizer.json").is_file():
            raise ValueError(f"--model {self.model}: no tokenizer.json in that directory")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template}: file not found")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} out of range")
        for name in ("max_batch_texts", "max_text_chars", "max_total_chars", "max_chat_messages",
                     "max_template_chars", "max_detokenize_requests", "worker_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_render_s <= 0:
            raise ValueError(f"max_render_s must be positive, got {self.max_render_s}")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
