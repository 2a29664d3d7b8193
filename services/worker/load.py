"""The real model behind serve(): the weights loaded into a ModelRunner on the engine thread,
with what surrounds it there (the step profiler, the other tensor-parallel ranks)."""
from __future__ import annotations

import logging
import os
import time

import torch

from services.common.spec_config import parse_spec_config

from services.worker.config import WorkerConfig
from services.worker.control import WorkerControlServicer
from services.worker.engine import LoadFailed, RunnerSource
from services.worker.kv_export import serve_exports
from services.worker.models import load_model
from services.worker.models.config import ModelConfigError
from services.worker.profiling import StepProfiler
from services.worker.runner import ModelRunner
from services.worker.tp import shard_model
from services.worker.tp_ranks import TpLink, start_ranks

log = logging.getLogger("meshllm.worker")


def load_model_runner(cfg: WorkerConfig, tp: TpLink | None = None) -> ModelRunner:
    """Load this rank's model (its shard with `tp`), allocate the KV cache and capture the decode
    graphs (ModelRunner). A model this worker cannot serve raises LoadFailed."""
    try:
        return _load(cfg, tp)
    except ModelConfigError as exc:
        raise LoadFailed(str(exc)) from None


def _load(cfg: WorkerConfig, tp: TpLink | None) -> ModelRunner:
    torch.set_num_threads(cfg.threads)
    t0 = time.monotonic()
    device = torch.device(cfg.rank_device)
    if tp is not None:
        tp.connect(device)
    model = load_model(cfg.model, device, cfg.torch_dtype, cfg.max_model_len or None, quantization=cfg.quantization)
    if tp is not None:
        model = shard_model(model, tp.rank, tp.size, tp.group)
    runner = ModelRunner(model, model_name=cfg.served_model_name, kv_cache_bytes=cfg.kv_cache_bytes,
                         num_kv_blocks=cfg.num_kv_blocks or None, block_size=cfg.block_size,
                         enforce_eager=cfg.enforce_eager, kv_cache_dtype=cfg.kv_torch_dtype,
                         seed_rng=tp.seed_rng if tp is not None else None,
                         tokenizer_path=os.path.join(cfg.model, "tokenizer.json"),
                         export_kv=cfg.kv_export,
                         export_nixl=cfg.kv_direct_transport in ("nixl", "auto"))
    if runner.exported is not None:
        runner.kv_export_addr = cfg.bound_grpc_addr
    runner.constraints.warm()   # structured outputs' tokenizer, built in the background now
    tiers = tier_config(cfg, runner)
    if tiers is not None:
        runner.enable_kv_tiers(tiers)
    spec = parse_spec_config(cfg.speculative_config)
    if tp is not None:
        tp.attach(runner)   # every rank: the tiers' agreement, the exported caches shared with rank 0
    if spec is not None:
        from services.worker.spec.decoder import SpecDecoder
        draft = None
        # Tensor parallel: rank 0 proposes for every rank (runner.tp_spec); a draft model, whole
        # (not sharded), lives on rank 0 only, with its own KV pool: the target's block count and size.
        follower = tp is not None and tp.rank != 0
        if spec.method == "draft_model" and not follower:
            from services.worker.spec.draft_model import load_draft_model
            draft = load_draft_model(spec, model, runner.num_blocks, runner.block_size, dtype=cfg.torch_dtype,
                                     max_num_tokens=runner.max_num_tokens, cuda_graphs=not cfg.enforce_eager)
        runner.enable_spec(SpecDecoder(spec, cfg.served_model_name, draft=draft, follower=follower))
        # The CPU's steps are slow and grow with their tokens from the start: a short curve.
        runner.spec.calibrate(runner, max_tokens=min(512 if device.type == "cuda" else 48, runner.max_num_tokens))
    if cfg.overlap_steps != "auto":
        runner.overlap = cfg.overlap_steps == "on"
    if tp is not None:
        tp.barrier()  # ready means every rank holds its shard and KV cache
    log.info("model %s ready in %.1fs on %s (%s, %d threads), max_model_len %d, step overlap %s",
             cfg.served_model_name, time.monotonic() - t0, device, str(model.dtype).removeprefix("torch."),
             torch.get_num_threads(), model.max_model_len, "on" if runner.overlap else "off")
    return runner


def tier_config(cfg: WorkerConfig, runner: ModelRunner):
    """The KV tiers this rank uses (docs/kv_tiers.md), or None: tier-1 host offload with
    --kv-offload-gb, kvstore fetches and saves with --kvstore-addr, direct hand-offs with --kv-export.
    Tensor parallel: every rank keeps its own shard in each, the kvstore's under its own namespace
    (it binds tp_size and tp_rank), and the ranks agree on what ended (tier_agreement.py)."""
    from services.worker.kv_tiers import TierConfig, layout
    client = make_ns = None
    if cfg.kvstore_addr:
        from services.common.kv_namespace import engine_namespace, weights_fingerprint
        try:
            fingerprint = weights_fingerprint(cfg.model)
        except (OSError, ValueError) as exc:
            log.warning("kvstore tier off: cannot fingerprint the weights (%s)", exc)
        else:
            from services.common.kv_client import KvClient
            client = KvClient(cfg.kvstore_addr, credentials=cfg.internal_tls.channel_credentials())
            dtype = str(runner.model.dtype).removeprefix("torch.") + ("+fp8-weights" if cfg.quantization == "fp8" else "")
            kv_dtype = str(runner.kv_dtype).removeprefix("torch.")

            def make_ns(block_size: int, block_bytes: int):
                return engine_namespace(cfg.model, cfg.served_model_name, dtype=dtype, kv_cache_dtype=kv_dtype,
                                        block_size=block_size, num_layers=runner.model.cfg.num_layers,
                                        tp_size=cfg.tensor_parallel_size, tp_rank=cfg.tp_rank,
                                        block_bytes=block_bytes, layout=layout(runner.kv_dtype, block_size),
                                        fingerprint=fingerprint)
    direct = cfg.kv_export
    if client is None and cfg.kv_offload_gb <= 0 and not direct:
        return None
    return TierConfig(offload_bytes=int(cfg.kv_offload_gb * 2**30), client=client, make_namespace=make_ns,
                      load_timeout_s=cfg.kv_load_timeout_ms / 1e3, save_buffer_bytes=int(cfg.kv_save_buffer_mb * 2**20),
                      direct=direct, peer_credentials=cfg.internal_tls.channel_credentials() if direct else None,
                      direct_transport=cfg.kv_direct_transport,
                      tp_size=cfg.tensor_parallel_size, tp_rank=cfg.tp_rank)


def model_source(cfg: WorkerConfig) -> RunnerSource:
    """serve()'s source for the real model. With --tensor-parallel-size N this starts ranks
    1..N-1 (serve calls it before any gRPC thread exists: they are forked from this process)."""
    tp = ranks = None
    rank_cfg = cfg
    if cfg.tensor_parallel_size > 1:
        try:
            rank_cfg, ranks = start_ranks(cfg)
        except ModelConfigError as exc:
            raise LoadFailed(str(exc)) from None
        tp = TpLink(rank_cfg)
    profiler = StepProfiler(cfg.profile_dir, cfg.rank_device)
    control = WorkerControlServicer(profiler)

    def load():
        # serve() binds the gRPC port (cfg.bound_grpc_addr: where peers ask for the KV export)
        # after this source was made, on the config it was given.
        rank_cfg.bound_grpc_addr = cfg.bound_grpc_addr
        runner = load_model_runner(rank_cfg, tp)
        if runner.exported is not None:   # peers may map it from now on (WorkerControl.ExportKv)
            control.kv_export = tp.export_of if tp is not None else serve_exports(lambda: runner.exported.describe())
        return runner
    return RunnerSource(load=load, control=control,
                        profiler=profiler, tp=tp, stop_ranks=None if ranks is None else ranks.stop)
