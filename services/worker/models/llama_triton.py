"""The Llama-family forward on a GPU through the Triton kernels (services/worker/kernels/).

Same math as LlamaModel.forward (the torch reference, which stays the CPU path and the oracle),
fused where it saves a pass over the activations or a launch: one kernel takes the fused qkv output
through Qwen3's q/k norm, RoPE (in place) and the K/V write into the paged cache; residual-add +
RMSNorm is one kernel, SiLU·mul another. GEMMs are cuBLAS through torch; with FP8 weights
(--quantization fp8) kernels/fp8.py (per-token FP8 activations x cuBLASLt, a Triton GEMV at one row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.kernels.attention import paged_attention
from services.worker.kernels.embedding import embed_tokens
from services.worker.kernels.fp8 import fp8_linear
from services.worker.kernels.gemv import linear
from services.worker.kernels.elementwise import add_rms_norm, silu_mul
from services.worker.kernels.qkv_prep import qkv_prep_
from services.worker.models.fp8 import Fp8Weight
from services.worker.models.llama import LlamaModel, rope_cos_sin


@dataclass
class KernelAttnInputs:
    """Per-step attention inputs, device tensors (views of the executor's persistent buffers)."""

    slot_mapping: torch.Tensor      # [T] long: cache slot of each token (-1: padding, not written)
    block_tables: torch.Tensor      # [S, max_blocks] int32
    query_start_loc: torch.Tensor   # [S + 1] int32
    seq_lens: torch.Tensor          # [S] int32: context length incl. this step's tokens
    max_query_len: int              # sizes the grid (1 for decode-only steps)
    num_splits: int = 1             # split-KV programs per sequence (decode only)


def proj(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """The wide projections (qkv, gate_up): cuBLAS for bf16 weights, kernels/fp8.py for FP8 ones."""
    return fp8_linear(x, w, bias) if isinstance(w, Fp8Weight) else F.linear(x, w, bias)


def proj_gemv(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """o and down: the Triton GEMV at one row for bf16 weights (gemv.py), kernels/fp8.py for FP8."""
    return fp8_linear(x, w, bias) if isinstance(w, Fp8Weight) else linear(x, w, bias)


def rope_tables_f32(model: LlamaModel) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [max_len, d], built once: bf16 tables would round Llama 3's scaled angles."""
    if getattr(model, "_rope_f32", None) is None:
        model._rope_f32 = rope_cos_sin(model.cfg, model.max_model_len, torch.float32, model.device)
    return model._rope_f32


def forward_triton(model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn: KernelAttnInputs, kv_caches: list[torch.Tensor],
                   prev_src: torch.Tensor | None = None,
                   prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids, positions: [T] long -> final-normed hidden states [T, H]. With prev_src [T]
    long, a row whose prev_src is >= 0 takes its id from prev_tokens[prev_src] (the previous
    step's sampled ids, still on the device) instead of input_ids."""
    cfg = model.cfg
    t = input_ids.shape[0]
    nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    cos, sin = rope_tables_f32(model)
    if prev_src is None:
        residual = F.embedding(input_ids, model.embed)                              # [T, H]
    else:
        residual = embed_tokens(model.embed, input_ids, prev_src, prev_tokens)
    x = add_rms_norm(residual, model.layers[0].input_norm, eps)
    attn_out = torch.empty(t, nh, d, dtype=model.dtype, device=model.device)
    for i, (layer, kv_cache) in enumerate(zip(model.layers, kv_caches)):
        qkv = proj(x, layer.qkv, layer.qkv_bias)                                   # [T, (nh+2kvh)*d]
        # One kernel: Qwen3's per-head q/k RMSNorm (if any), RoPE in place, K/V into the cache.
        qkv_prep_(qkv, positions, cos, sin, kv_cache, attn.slot_mapping, nh, kvh, d,
                  q_norm=layer.q_norm, k_norm=layer.k_norm, eps=eps)
        q = qkv[:, :nh * d].view(t, nh, d)
        paged_attention(q, kv_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens,
                        attn.max_query_len, model.scale, out=attn_out,
                        sliding_window=cfg.sliding_window, num_splits=attn.num_splits)
        o = model.reduce(proj_gemv(attn_out.view(t, nh * d), layer.o, layer.o_bias))   # M = 1: gemv.py
        x = add_rms_norm(o, layer.post_norm, eps, residual=residual)                # residual += o
        gate_up = proj(x, layer.gate_up, layer.gate_up_bias)                        # [T, 2I]
        mlp = model.reduce(proj_gemv(silu_mul(gate_up), layer.down, layer.down_bias))
        next_norm = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else model.final_norm
        x = add_rms_norm(mlp, next_norm, eps, residual=residual)                    # residual += mlp
    return x


def compute_logits_triton(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """model.compute_logits with the single-row case through the GEMV kernel (batch-1 decode
    streams the 1 GB lm_head of Llama 3 every step)."""
    return linear(hidden, model.lm_head).float()
