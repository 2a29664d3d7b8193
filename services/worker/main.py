"""`python -m services.worker --model DIR --zmq-addr ADDR ...`: parse flags, validate, pick the runner, serve."""
from __future__ import annotations

import argparse
import asyncio
import os

from services.common import telemetry
from services.common import internal_tls
from services.common.kv_blocks import add_kvstore_flag
from services.common.log import setup_logging
from services.common.metrics import add_metrics_args
from services.common.profiling import default_profile_dir
from services.common.zmq_curve import CurveServerKeys
from services.worker.config import DTYPES, KV_CACHE_DTYPES, OVERLAP_MODES, QUANTIZATIONS, WorkerConfig


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
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): float8 e4m3 with scale 1.0, "
                        "half the bytes per block of bf16 (docs/gpu.md)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="fp8: e4m3 projection weights with per-output-channel scales, computed at load from "
                        "the checkpoint's weights (an FP8 checkpoint is served as stored whatever this says); "
                        "embedding, lm_head and norms stay in --dtype (docs/gpu.md)")
    p.add_argument("--speculative-config", default="",
                   help="speculative decoding, vLLM's JSON (docs/speculative_decoding.md); off by default")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="exact number of KV blocks (overrides the budget)")
    p.add_argument("--block-size", type=int, default=16, help="initial KV block size (WorkerHello may change it)")
    p.add_argument("--served-model-name", default="", help="model name reported to the scheduler")
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: all cores)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--overlap-steps", choices=OVERLAP_MODES,
                   default=os.environ.get("MESHLLM_OVERLAP_STEPS", "auto"),
                   help="launch step N+1 before reading step N's tokens (host work hidden behind the "
                        "GPU); auto: on for CUDA, off on the CPU (nothing to hide there). "
                        "Default from MESHLLM_OVERLAP_STEPS")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N ranks (one process each; on CUDA rank r uses cuda:r) "
                        "joined by torch.distributed (NCCL on GPUs, gloo on CPUs); N must divide the "
                        "attention heads, KV heads and MLP size")
    # Internal: how rank 0 starts the other ranks (services/worker/tp_ranks.py).
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tp-init-method", default="", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=None, help="DEBUG logs one line per step")
    add_metrics_args(p, engine_id=True)
    p.add_argument("--simulate", action="store_true",
                   help="no model, no torch: speak the step protocol and sample pseudo-random tokens "
                        "(to measure the gateway, tokenizer and scheduler alone)")
    p.add_argument("--simulate-step-ms", type=float, default=0.0, help="simulated time of one step")
    p.add_argument("--simulate-token-ms", type=float, default=0.0, help="simulated time per scheduled token")
    p.add_argument("--profile-dir", default=default_profile_dir(),
                   help="torch.profiler traces go under this directory (WorkerControl); "
                        "default $MESHLLM_CACHE/profiles or ~/.cache/meshllm/profiles")
    add_kvstore_flag(p)
    p.add_argument("--kv-offload-gb", type=float, default=0.0,
                   help="tier 1: keep blocks the device cache evicts in this much host memory (pinned on a "
                        "GPU) and copy them back on a prefix hit; 0: off (docs/kv_tiers.md)")
    p.add_argument("--kv-load-timeout-ms", type=float, default=2000.0,
                   help="a kvstore fetch not done in this long is cut short; its blocks are recomputed")
    p.add_argument("--kv-export", action="store_true",
                   help="direct prefill->decode hand-offs on one host (docs/pd.md): keep the KV cache in memory "
                        "another worker can map (memfd / CUDA IPC) and copy handed-off blocks from peers' caches")
    p.add_argument("--kv-direct-transport", default="mmap", choices=["mmap", "nixl", "auto"],
                   help="direct hand-offs: mmap = the mapped cache (memfd / CUDA IPC), same host only; nixl = NIXL "
                        "(UCX) always; auto = mmap on one host, NIXL for a peer on another (nixl and auto load NIXL)")
    p.add_argument("--kv-save-buffer-mb", type=float, default=256.0,
                   help="host buffers of kvstore saves in flight; past them a save is dropped, never waited for")
    internal_tls.add_flags(p)
    p.add_argument("--zmq-curve-secret-key", default="",
                   help="CURVE on the ROUTER: this worker's secret key file (NAME.key_secret)")
    p.add_argument("--zmq-curve-clients", default="",
                   help="CURVE on the ROUTER: directory of the allowed clients' public key files (*.key)")
    a = p.parse_args(argv)
    setup_logging("worker" if not a.tp_rank else f"worker-rank{a.tp_rank}", a.log_level)
    if a.log_level:  # the other tensor-parallel ranks inherit it
        os.environ["MESHLLM_LOG_LEVEL"] = a.log_level
    try:
        return WorkerConfig(model=a.model, zmq_addr=a.zmq_addr, host=a.host, grpc_port=a.grpc_port,
                            device=a.device, dtype=a.dtype, max_model_len=a.max_model_len,
                            kv_cache_memory_gb=a.kv_cache_memory_gb, kv_cache_dtype=a.kv_cache_dtype,
                            quantization=a.quantization, speculative_config=a.speculative_config,
                            num_kv_blocks=a.num_kv_blocks,
                            block_size=a.block_size, served_model_name=a.served_model_name,
                            num_threads=a.num_threads, enforce_eager=a.enforce_eager, overlap_steps=a.overlap_steps,
                            simulate=a.simulate,
                            simulate_step_ms=a.simulate_step_ms, simulate_token_ms=a.simulate_token_ms,
                            profile_dir=a.profile_dir, tensor_parallel_size=a.tensor_parallel_size, tp_rank=a.tp_rank,
                            tp_init_method=a.tp_init_method, internal_tls=internal_tls.from_args(a),
                            zmq_curve=CurveServerKeys(a.zmq_curve_secret_key, a.zmq_curve_clients),
                            engine_id=a.engine_id, metrics_port=a.metrics_port, kvstore_addr=a.kvstore_addr,
                            kv_offload_gb=a.kv_offload_gb, kv_load_timeout_ms=a.kv_load_timeout_ms,
                            kv_save_buffer_mb=a.kv_save_buffer_mb, kv_export=a.kv_export,
                            kv_direct_transport=a.kv_direct_transport)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(telemetry.init_service("worker", argv))  # tracing flags + OTEL_*
    # OpenMP threads that spin at barriers collapse throughput (5x measured) when the worker
    # shares cores with the other services; sleeping threads cost little. Must be set before
    # torch (and its OpenMP runtime) is loaded; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The runner is picked here; torch is imported only after the flags are valid, and never for
    # the simulated runner.
    if cfg.tp_rank:  # a tensor-parallel rank started by rank 0: no sockets, plans come from rank 0
        from services.worker.load import load_model_runner
        from services.worker.tp_ranks import follower_main
        return follower_main(cfg, load_model_runner)
    from services.worker.engine import serve
    if cfg.simulate:
        from services.worker.simulated import simulated_source as source
    else:
        from services.worker.load import model_source as source
    return asyncio.run(serve(cfg, source))
