"""The Llama-family forward on a GPU through the Triton kernels (services/worker/kernels/).

Same math as LlamaModel.forward (the torch reference, which stays the CPU path and the oracle),
fused where it saves a pass over the activations or a launch: one kernel takes the fused qkv output
through Qwen3's q/k norm, RoPE (in place) and the K/V write into the paged cache; residual-add +
RMSNorm is one kernel, SiLU·mul another. GEMMs are cuBLAS through torch; with FP8 weights
(--quantization fp8) kernels/fp8.py: a Triton GEMV at one row; from two rows on, the norm and
SiLU·mul write their output as per-token FP8 (the attention output gets its own quantiser), the
GEMM runs unit-scaled, and the kernel after it applies the scales as it reads the product.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.kernels.attention import paged_attention
from services.worker.kernels.embedding import embed_tokens
from services.worker.kernels import fp8 as fp8_kernels
from services.worker.kernels.fp8 import fp8_linear, quantize_rows, unscaled_mm
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
    # A mixed step: its one-token sequences attend in one launch with decode tiles (and
    # decode_splits KV splits), the others in a second with prefill tiles (max_query_len theirs).
    decode_ids: torch.Tensor | None = None
    prefill_ids: torch.Tensor | None = None
    decode_splits: int = 1


# With FP8 weights and >= 2 rows: producers quantise, consumers scale (see forward_triton). False:
# every FP8 projection is one fp8_linear call (bench/gpu_fp8.py times both in one run; tests compare).
FUSED_FP8 = True


def proj(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """The wide projections (qkv, gate_up): cuBLAS for bf16 weights, kernels/fp8.py for FP8 ones."""
    return fp8_linear(x, w, bias) if isinstance(w, Fp8Weight) else F.linear(x, w, bias)


def proj_gemv(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """o and down: the Triton GEMV at one row for bf16 weights (gemv.py), kernels/fp8.py for FP8."""
    return fp8_linear(x, w, bias) if isinstance(w, Fp8Weight) else linear(x, w, bias)


def project(x, w, bias: torch.Tensor | None, plain, dtype: torch.dtype):
    """x @ W^T (+ bias) -> (output, in_scales). x may be a (e4m3, per-token scales) pair made by its
    producer: then W is FP8 and the output is the unscaled product, whose (token, channel) scales
    come back for the consumer to apply. Otherwise `plain` (proj or proj_gemv) and no scales."""
    if isinstance(x, tuple):
        return unscaled_mm(x, w, dtype), (x[1], w.scale)
    return plain(x, w, bias), None


def attend(q: torch.Tensor, kv_cache: torch.Tensor, attn: KernelAttnInputs, scale: float, out: torch.Tensor,
           window: int | None) -> None:
    """Paged attention of one layer into `out`: one launch, or for a mixed step two (its decodes
    with decode tiles, its prompt chunks with prefill tiles: a prefill-shaped grid would give each
    decode as many mostly idle programs as the longest chunk has query tiles)."""
    launches = ([(attn.max_query_len, attn.num_splits, None)] if attn.decode_ids is None else
                [(1, attn.decode_splits, attn.decode_ids), (attn.max_query_len, 1, attn.prefill_ids)])
    for max_query_len, splits, seq_ids in launches:
        paged_attention(q, kv_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens, max_query_len, scale,
                        out=out, sliding_window=window, num_splits=splits, seq_ids=seq_ids)


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
    layers = model.layers

    def fp8_in(w, bias, row_parallel: bool = False) -> bool:
        """The projection takes per-token FP8 input from its producer and leaves its scales to its
        consumer (kernels/fp8.py); not with a bias, nor for a row-parallel projection under tensor
        parallelism (each rank's product must be scaled before the all-reduce)."""
        return (FUSED_FP8 and isinstance(w, Fp8Weight) and bias is None and t >= fp8_kernels.W8A8_MIN_ROWS
                and not (row_parallel and model.tp_size > 1))

    x = add_rms_norm(residual, layers[0].input_norm, eps, fp8_out=fp8_in(layers[0].qkv, layers[0].qkv_bias))
    attn_out = torch.empty(t, nh, d, dtype=model.dtype, device=model.device)
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
        qkv, scales = project(x, layer.qkv, layer.qkv_bias, proj, model.dtype)   # [T, (nh+2kvh)*d]
        # One kernel: Qwen3's per-head q/k RMSNorm (if any), RoPE in place, K/V into the cache.
        qkv_prep_(qkv, positions, cos, sin, kv_cache, attn.slot_mapping, nh, kvh, d,
                  q_norm=layer.q_norm, k_norm=layer.k_norm, eps=eps, in_scales=scales)
        q = qkv[:, :nh * d].view(t, nh, d)
        attend(q, kv_cache, attn, model.scale, attn_out, cfg.sliding_window)
        a = attn_out.view(t, nh * d)
        if fp8_in(layer.o, layer.o_bias, row_parallel=True):
            a = quantize_rows(a)
        o, scales = project(a, layer.o, layer.o_bias, proj_gemv, model.dtype)      # M = 1: gemv.py
        x = add_rms_norm(model.reduce(o), layer.post_norm, eps, residual=residual,  # residual += o
                         in_scales=scales, fp8_out=fp8_in(layer.gate_up, layer.gate_up_bias))
        gate_up, scales = project(x, layer.gate_up, layer.gate_up_bias, proj, model.dtype)   # [T, 2I]
        m = silu_mul(gate_up, in_scales=scales, fp8_out=fp8_in(layer.down, layer.down_bias, row_parallel=True))
        mlp, scales = project(m, layer.down, layer.down_bias, proj_gemv, model.dtype)
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        x = add_rms_norm(model.reduce(mlp), nxt.input_norm if nxt else model.final_norm, eps,
                         residual=residual, in_scales=scales,                      # residual += mlp
                         fp8_out=nxt is not None and fp8_in(nxt.qkv, nxt.qkv_bias))
    return x


def compute_logits_triton(model: LlamaModel, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
    """model.compute_logits with the single-row case through the GEMV kernel (batch-1 decode
    streams the 1 GB lm_head of Llama 3 every step). `as_float` False: the logits stay in the
    model's dtype (decode graphs: sampling.sample_async widens them only where it must)."""
    logits = linear(hidden, model.lm_head)
    return logits.float() if as_float else logits
