"""Tensor parallelism for the Llama family (Megatron layout) over torch.distributed.

Rank r of N keeps, per layer: q heads [r*nh/N, (r+1)*nh/N) and kv heads [r*kvh/N, ...) of the
fused qkv (column-parallel), the matching input columns of o (row-parallel), gate and up rows
[r*I/N, ...) (column-parallel) and the matching input columns of down (row-parallel). Embedding,
norms and lm_head are replicated. The forward's two all-reduces (after o and after down) live in
LlamaModel.reduce. Row-parallel biases are added by rank 0 only, so the sum counts them once.
Every rank runs the same StepPlan, so every rank samples the same tokens (greedy, or seeded noise).

Backends: NCCL on GPUs, gloo on CPUs. `init_tp` expects MASTER_ADDR/MASTER_PORT (env://) or an
explicit init_method such as tcp://127.0.0.1:PORT.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from services.worker.models.config import ModelConfig, ModelConfigError
from services.worker.models.fp8 import Fp8Weight
from services.worker.models.llama import LayerWeights, LlamaModel


def init_tp(rank: int, world_size: int, device: torch.device, init_method: str = "env://",
            timeout_s: float | None = None):
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    return dist.group.WORLD


def check_tp_size(cfg: ModelConfig, world_size: int) -> None:
    """Raise ModelConfigError unless `world_size` ranks can split the model evenly."""
    nh, kvh, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if world_size < 1 or nh % world_size or kvh % world_size or inter % world_size:
        raise ModelConfigError(f"tensor parallel size {world_size} must divide num_heads {nh}, "
                               f"num_kv_heads {kvh} and intermediate_size {inter}")


def _rows(t: torch.Tensor | None, start: int, size: int) -> torch.Tensor | None:
    return None if t is None else t[start:start + size].contiguous()


def _take_rows(w, spans: list[tuple[int, int]]):
    """Rows [start, start + size) of each span, concatenated (a tensor or an Fp8Weight)."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight.cat([w.rows(a, n) for a, n in spans])
    return torch.cat([w[a:a + n] for a, n in spans]).contiguous()


def _take_cols(w, start: int, size: int):
    if isinstance(w, Fp8Weight):
        return w.cols(start, size)     # per-output-channel scales: unchanged by a K split
    return w[:, start:start + size].contiguous()


def shard_model(model: LlamaModel, rank: int, world_size: int, group=None) -> LlamaModel:
    """The rank's shard of a loaded (full) model, as a new LlamaModel wired to `group`."""
    cfg = model.cfg
    n = world_size
    nh, kvh, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    check_tp_size(cfg, n)
    qs, ks, i_s = nh // n * d, kvh // n * d, inter // n
    layers = []
    for lw in model.layers:
        qkv = _take_rows(lw.qkv, [(rank * qs, qs), (nh * d + rank * ks, ks), (nh * d + kvh * d + rank * ks, ks)])
        qkv_bias = None
        if lw.qkv_bias is not None:
            qb, kb, vb = lw.qkv_bias.split([nh * d, kvh * d, kvh * d])
            qkv_bias = torch.cat([qb[rank * qs:(rank + 1) * qs], kb[rank * ks:(rank + 1) * ks],
                                  vb[rank * ks:(rank + 1) * ks]])
        gate_up = _take_rows(lw.gate_up, [(rank * i_s, i_s), (inter + rank * i_s, i_s)])
        gate_up_bias = None
        if lw.gate_up_bias is not None:
            gb, ub = lw.gate_up_bias.chunk(2)
            gate_up_bias = torch.cat([gb[rank * i_s:(rank + 1) * i_s], ub[rank * i_s:(rank + 1) * i_s]])
        layers.append(LayerWeights(
            input_norm=lw.input_norm, qkv=qkv, qkv_bias=qkv_bias,
            o=_take_cols(lw.o, rank * qs, qs),
            o_bias=lw.o_bias if rank == 0 else None,
            post_norm=lw.post_norm, gate_up=gate_up, gate_up_bias=gate_up_bias,
            down=_take_cols(lw.down, rank * i_s, i_s),
            down_bias=lw.down_bias if rank == 0 else None,
            q_norm=lw.q_norm, k_norm=lw.k_norm))
    local_cfg = dataclasses.replace(cfg, num_heads=nh // n, num_kv_heads=kvh // n, intermediate_size=i_s)
    shard = LlamaModel(local_cfg, model.embed, layers, model.final_norm, model.lm_head, model.max_model_len)
    shard.tp_group, shard.tp_size = group, n
    return shard
