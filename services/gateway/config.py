"""The gateway's one validated config (flags are read only in main.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.common.internal_tls import InternalTls
from services.common.tls import TlsConfig


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000                  # HTTP (OpenAI API); 0 = a free port
    grpc_port: int = 50051            # public gRPC API + health; 0 = a free port
    health_port: int = 0              # grpc.health.v1 on its own threads (health_thread.py); 0 = off
    # Several gateway processes on the same HTTP and gRPC ports (SO_REUSEPORT; the launcher's
    # --api-server-count). metrics_multiproc_dir: PROMETHEUS_MULTIPROC_DIR, where every one
    # of them writes its metrics, so that /metrics on any of them counts all (shared_metrics.py).
    reuse_port: bool = False
    metrics_multiproc_dir: str = ""
    # Replicas: several tokenizers (failover) and several engines (routed); with a
    # supervisor_addr, both sets follow the supervisor's WatchReplicas (these are the start).
    tokenizer_addrs: list[str] = field(default_factory=lambda: ["127.0.0.1:50052"])
    engine_addrs: list[str] = field(default_factory=lambda: ["127.0.0.1:50053"])
    supervisor_addr: str = ""
    route_busy_ratio: float = 1.5         # router: the affine replica is "much busier" past
    route_busy_slack_tokens: int = 2048   # ratio * least-loaded + slack outstanding tokens
    max_route_attempts: int = 3           # replicas one request may be tried on before a token
    embedder_addr: str = ""           # the embedder's gRPC address; "": no /v1/embeddings
    profiler_addr: str = ""           # the profiler service (/profile/*); "": those routes 404
    served_model_name: str = "smollm2-135m-instruct"
    max_body_bytes: int = 4 * 1024 * 1024
    max_inflight_requests: int = 4096  # bounds every per-request map in the gateway
    max_inflight_tokens: int = 8 * 1024 * 1024  # prompt + max_tokens of requests in flight
    max_compression_ratio: float = 200.0  # Content-Encoding bodies: decompressed / compressed
    max_stop_strings: int = 32
    max_stop_string_chars: int = 512
    tokenizer_timeout_s: float = 30.0
    # HTTP connections (guard/connections.py): the cap (0: min(8192, RLIMIT_NOFILE / 2)), and
    # the deadlines that close idle, slow and stalled connections.
    max_connections: int = 0
    keep_alive_timeout_s: float = 5.0     # idle: after connect or a response, to the next byte
    header_timeout_s: float = 10.0        # a request head, from its first byte to its end
    body_timeout_s: float = 10.0          # a body brings body_min_rate bytes/s in each such window
    body_min_rate: int = 1024
    max_header_bytes: int = 16 * 1024     # the request line and headers, whether in one read or many
    max_headers: int = 100
    shutdown_grace_s: float = 2.0
    # Stored Responses API responses (openai/responses_store.py): LRU past either bound, gone
    # after the time to live; 0 entries = nothing stored.
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 * 1024 * 1024
    responses_store_ttl_s: float = 3600.0
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (shows the chat template): off, as vLLM
    log_level: str = "INFO"
    reasoning_parser: str | None = None   # a name in parsers.REASONING_PARSERS
    tool_call_parser: str | None = None   # a name in parsers.TOOL_PARSERS
    api_keys: list[str] = field(default_factory=list)        # none: the API is open
    admin_api_keys: list[str] = field(default_factory=list)  # none: admin routes refused
    tls: TlsConfig = field(default_factory=TlsConfig)        # HTTP and public gRPC
    internal_tls: InternalTls = field(default_factory=InternalTls)  # mTLS to our own services

    def __post_init__(self) -> None:
        from services.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        for name in ("port", "grpc_port", "health_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got {value}")
        if self.metrics_multiproc_dir and not os.path.isdir(self.metrics_multiproc_dir):
            raise ValueError(f"PROMETHEUS_MULTIPROC_DIR {self.metrics_multiproc_dir!r} is not a directory")
        for flag, values in (("--tokenizer-addr", self.tokenizer_addrs),
                             ("--engine-addr", self.engine_addrs)):
            if not values and not self.supervisor_addr:
                raise ValueError(f"{flag} is required (or --supervisor-addr)")
            for value in values:
                if not value or ":" not in value:
                    raise ValueError(f"{flag} must be HOST:PORT, got {value!r}")
        if self.supervisor_addr and ":" not in self.supervisor_addr:
            raise ValueError(f"--supervisor-addr must be HOST:PORT, got {self.supervisor_addr!r}")
        if not self.route_busy_ratio >= 1 or self.route_busy_slack_tokens < 0:
            raise ValueError("--route-busy-ratio must be >= 1 and --route-busy-slack-tokens >= 0")
        if self.max_route_attempts < 1:
            raise ValueError("--max-route-attempts must be at least 1")
        if self.embedder_addr and ":" not in self.embedder_addr:
            raise ValueError(f"--embedder-addr must be HOST:PORT, got {self.embedder_addr!r}")
        if self.profiler_addr and ":" not in self.profiler_addr:
            raise ValueError(f"--profiler-addr must be HOST:PORT, got {self.profiler_addr!r}")
        if not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1024")
        if self.max_inflight_requests < 1:
            raise ValueError("--max-inflight-requests must be at least 1")
        if self.max_inflight_tokens < 1:
            raise ValueError("--max-inflight-tokens must be at least 1")
        if not self.max_compression_ratio >= 1:
            raise ValueError("--max-compression-ratio must be at least 1")
        if self.max_stop_strings < 0 or self.max_stop_string_chars < 1:
            raise ValueError("stop-string limits must be positive")
        if self.responses_store_max_entries < 0 or self.responses_store_max_bytes < 0:
            raise ValueError("--responses-store-max-entries and --responses-store-max-bytes "
                             "must be >= 0")
        if not self.responses_store_ttl_s > 0:
            raise ValueError("--responses-store-ttl-s must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError("--shutdown-grace-s must be >= 0")
        if self.tokenizer_timeout_s <= 0:
            raise ValueError("--tokenizer-timeout-s must be positive")
        if self.max_connections < 0:
            raise ValueError("--max-connections must be >= 0 (0: min(8192, RLIMIT_NOFILE / 2))")
        for name in ("keep_alive_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.body_min_rate < 1:
            raise ValueError("--body-min-rate must be at least 1 byte/s")
        if self.max_header_bytes < 1024 or self.max_headers < 8:
            raise ValueError("--max-header-bytes must be at least 1024 and --max-headers at least 8")
