"""`python -m services.worker --model DIR --zmq-addr ADDR ...`: parse flags, validate, serve."""
from __future__ import annotations

import argparse
import asyncio
import os

from services.common.log import setup_logging
from services.worker.config import DTYPES, WorkerConfig


def parse_args(argv: list[str] | None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="python -m services.worker",
                                description="meshllm worker: model + paged KV cache on one device")
    p.add_argument("--model", required=True, help="HF-format model directory (config.json + safetensors)")
    p.add_argument("--zmq-addr", required=True,
                   help="ROUTER bind address for StepPlans, e.g. ipc:///tmp/w.ipc or tcp://127.0.0.1:PORT "
                        "(port 0 picks a free one and prints it)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC health bind host")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC health port (0: pick a free one)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's max_position_embeddings")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache budget in GiB")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="exact number of KV blocks (overrides the budget)")
    p.add_argument("--block-size", type=int, default=16, help="initial KV block size (WorkerHello may change it)")
    p.add_argument("--served-model-name", default="", help="model name reported to the scheduler")
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: all cores)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--log-level", default=None, help="DEBUG logs one line per step")
    p.add_argument("--simulate", action="store_true",
                   help="no model, no torch: speak the step protocol and sample pseudo-random tokens "
                        "(to measure the gateway, tokenizer and scheduler alone)")
    p.add_argument("--simulate-step-ms", type=float, default=0.0, help="simulated time of one step")
    p.add_argument("--simulate-token-ms", type=float, default=0.0, help="simulated time per scheduled token")
    a = p.parse_args(argv)
    setup_logging("worker", a.log_level)
    try:
        return WorkerConfig(model=a.model, zmq_addr=a.zmq_addr, host=a.host, grpc_port=a.grpc_port,
                            device=a.device, dtype=a.dtype, max_model_len=a.max_model_len,
                            kv_cache_memory_gb=a.kv_cache_memory_gb, num_kv_blocks=a.num_kv_blocks,
                            block_size=a.block_size, served_model_name=a.served_model_name,
                            num_threads=a.num_threads, enforce_eager=a.enforce_eager, simulate=a.simulate,
                            simulate_step_ms=a.simulate_step_ms, simulate_token_ms=a.simulate_token_ms)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # OpenMP threads that spin at barriers collapse throughput (5x measured) when the worker
    # shares cores with the other services; sleeping threads cost little. Must be set before
    # torch (and its OpenMP runtime) is loaded; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if cfg.simulate:
        from services.worker.simulated import serve as serve_simulated
        return asyncio.run(serve_simulated(cfg))
    from services.worker.server import serve  # torch import only after the flags are valid
    return asyncio.run(serve(cfg))
