"""`python -m services.tokenizer --model DIR [--host H] [--port P] [--chat-template FILE]`."""
from __future__ import annotations

import argparse
import asyncio
import sys

from services.common import telemetry
from services.common import internal_tls
from services.common.log import setup_logging
from services.common.metrics import add_metrics_args
from services.common.procs import install_stop_handlers
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.core import TokenizerLoadError


def _parser() -> argparse.ArgumentParser:
    d = TokenizerConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m services.tokenizer",
                                description="meshllm tokenizer service (gRPC meshllm.v1.Tokenizer)")
    p.add_argument("--model", required=True, help="HF-format model dir with tokenizer.json")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="0 = any free port")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file overriding the model's")
    p.add_argument("--max-batch-texts", type=int, default=d["max_batch_texts"].default)
    p.add_argument("--max-text-chars", type=int, default=d["max_text_chars"].default)
    p.add_argument("--max-total-chars", type=int, default=d["max_total_chars"].default)
    p.add_argument("--max-chat-messages", type=int, default=d["max_chat_messages"].default)
    p.add_argument("--max-template-chars", type=int, default=d["max_template_chars"].default,
                   help="cap on chat message chars and on the rendered prompt")
    p.add_argument("--max-render-s", type=float, default=d["max_render_s"].default,
                   help="chat template render time cap in seconds")
    p.add_argument("--max-detokenize-requests", type=int,
                   default=d["max_detokenize_requests"].default,
                   help="unfinished requests per Detokenize stream")
    p.add_argument("--worker-threads", type=int, default=d["worker_threads"].default)
    p.add_argument("--log-level", default=None)
    add_metrics_args(p)
    internal_tls.add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(telemetry.init_service("tokenizer", argv))  # tracing flags + OTEL_*
    try:
        config = TokenizerConfig(
            model=args.model, host=args.host, port=args.port, chat_template=args.chat_template,
            max_batch_texts=args.max_batch_texts, max_text_chars=args.max_text_chars,
            max_total_chars=args.max_total_chars, max_chat_messages=args.max_chat_messages,
            max_template_chars=args.max_template_chars, max_render_s=args.max_render_s,
            max_detokenize_requests=args.max_detokenize_requests,
            worker_threads=args.worker_threads, internal_tls=internal_tls.from_args(args),
            metrics_port=args.metrics_port)
    except ValueError as e:
        print(f"tokenizer: {e}", file=sys.stderr)
        return 2
    log = setup_logging("tokenizer", args.log_level)

    async def run() -> int:
        from services.tokenizer.server import serve  # grpc import after argument checks
        stop = asyncio.Event()
        install_stop_handlers(asyncio.get_running_loop(), stop)
        return await serve(config, stop)

    try:
        return asyncio.run(run())
    except TokenizerLoadError as e:
        log.error("cannot load tokenizer: %s", e)
        return 1
