"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral; Qwen2 via qkv bias, Qwen3 via q/k norm) over a paged KV cache.

Functions over plain tensors, no nn.Module: weights are loaded once and never trained.
Every forward runs a flattened varlen batch of T tokens from many requests; attention is
the only op that needs to know where one request ends (see attention.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.attention import AttnMetadata, paged_attention
from services.worker.models.config import ModelConfig
from services.worker.models.fp8 import Fp8Weight, mm


@dataclass
class LayerWeights:
    input_norm: torch.Tensor       # [H]
    # Projections are [out, in] tensors, or Fp8Weight with --quantization fp8 (models/fp8.py).
    qkv: torch.Tensor | Fp8Weight  # [(nh + 2*kvh) * d, H]  q, k, v projections fused
    qkv_bias: torch.Tensor | None  # [(nh + 2*kvh) * d]
    o: torch.Tensor | Fp8Weight    # [H, nh * d]
    post_norm: torch.Tensor        # [H]
    gate_up: torch.Tensor | Fp8Weight  # [2 * I, H]  gate and up projections fused
    down: torch.Tensor | Fp8Weight     # [H, I]
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [d] Qwen3: RMSNorm weight over each q head
    k_norm: torch.Tensor | None = None  # [d]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[d/2] float32 inverse frequencies, computed as transformers does (bit-identical)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
                  / (rs.high_freq_factor - rs.low_freq_factor))
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(cfg: ModelConfig, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_len, d] in HF rotate_half layout (the d/2 frequencies twice)."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos/sin: [T, 1, d]. HF convention: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 then cast back before the weight, exactly as HF LlamaRMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights of one Llama-family checkpoint plus the forward pass."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, max_model_len: int) -> None:
        self.cfg = cfg
        self.embed = embed              # [V, H]
        self.layers = layers
        self.final_norm = final_norm    # [H]
        self.lm_head = lm_head          # [V, H]; the same tensor as embed when tied
        self.device = embed.device
        self.dtype = embed.dtype
        self.max_model_len = max_model_len
        self.cos, self.sin = rope_cos_sin(cfg, max_model_len, self.dtype, self.device)
        self.scale = cfg.head_dim ** -0.5
        # Tensor parallel (services/worker/tp.py): this rank holds nh/N q heads, kvh/N kv heads and
        # I/N of the MLP; the row-parallel o and down projections end in one all-reduce each.
        self.tp_group = None
        self.tp_size = 1

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of every rank (identity without TP)."""
        if self.tp_size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.tp_group)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [T] long -> final-normed hidden states [T, H]."""
        cfg = self.cfg
        t = input_ids.shape[0]
        nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos.index_select(0, positions)[:, None, :]                          # [T, 1, d]
        sin = self.sin.index_select(0, positions)[:, None, :]
        h = F.embedding(input_ids, self.embed)                                        # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = mm(x, layer.qkv, layer.qkv_bias)                        # [T, (nh+2kvh)*d]
            q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
            q, k = q.view(t, nh, d), k.view(t, kvh, d)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            o = paged_attention(q, k, v.view(t, kvh, d), kv_cache, attn, self.scale)  # [T, nh, d]
            h = h + self.reduce(mm(o.reshape(t, nh * d), layer.o, layer.o_bias))
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = mm(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + self.reduce(mm(F.silu(gate) * up, layer.down, layer.down_bias))
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (only the rows that sample) -> float32 logits [N, V]."""
        return F.linear(hidden, self.lm_head).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache: [2, num_blocks, block_size, kvh, d]."""
        return (2, num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
        per_layer = 2 * block_size * self.cfg.num_kv_heads * self.cfg.head_dim
        return per_layer * self.cfg.num_layers * (kv_dtype or self.dtype).itemsize
