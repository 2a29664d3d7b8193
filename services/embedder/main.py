"""`python -m services.embedder --model DIR [--host H] [--port P] ...`: parse, validate, serve."""
from __future__ import annotations

import argparse
import asyncio
import os

from services.common import telemetry
from services.common import internal_tls
from services.common.log import setup_logging
from services.common.metrics import add_metrics_args
from services.common.procs import install_stop_handlers
from services.embedder.config import DTYPES, EmbedderConfig


def parse_args(argv: list[str] | None) -> EmbedderConfig:
    d = EmbedderConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m services.embedder",
                                description="meshllm embedder: sentence embeddings from a BERT "
                                            "encoder (gRPC meshllm.v1.Embedder)")
    p.add_argument("--model", required=True,
                   help="HF-format BERT directory (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="0 = any free port")
    p.add_argument("--device", default=d["device"].default, help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=d["dtype"].default, choices=DTYPES)
    p.add_argument("--served-model-name", default="", help="default: the model directory's name")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="longest input in tokens (0: the model's max_position_embeddings)")
    for name, help_ in (("max_items_per_request", "inputs per request"),
                        ("max_request_chars", "text characters per request"),
                        ("max_batch_items", "items in one forward pass"),
                        ("max_batch_tokens", "padded tokens in one forward pass"),
                        ("max_queued_items", "items waiting for the model (then RESOURCE_EXHAUSTED)")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=d[name].default, help=help_)
    p.add_argument("--batch-wait-ms", type=float, default=d["batch_wait_ms"].default,
                   help="how long an idle embedder waits for concurrent requests to batch")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--log-level", default=None)
    add_metrics_args(p)
    internal_tls.add_flags(p)
    a = p.parse_args(argv)
    try:
        tls = internal_tls.from_args(a)
        fields = {k: v for k, v in vars(a).items() if not k.startswith("internal_tls_")}
        return EmbedderConfig(**fields, internal_tls=tls)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(telemetry.init_service("embedder", argv))  # tracing flags + OTEL_*
    log = setup_logging("embedder", config.log_level)
    # Spinning OpenMP threads starve the other services sharing these cores (see the worker).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from services.embedder.bert import BertConfigError  # torch import after the flags are valid
    from services.embedder.server import serve

    async def run() -> int:
        stop = asyncio.Event()
        install_stop_handlers(asyncio.get_running_loop(), stop)
        return await serve(config, stop)

    try:
        return asyncio.run(run())
    except BertConfigError as exc:
        log.error("cannot load the embedding model: %s", exc)
        return 1
