"""FP8 (e4m3) weights with one float32 scale per output channel (`--quantization fp8`).

A quantised projection is an `Fp8Weight`: `weight` float8_e4m3fn [N, K] and `scale` float32 [N],
with W ~= weight.float() * scale[:, None]. It is made at load time from bf16 weights (the scale
of a row is its absolute maximum / 448, e4m3's largest finite value) or read as stored from an FP8
checkpoint (HF `quantization_config.quant_method: "fp8"` with per-tensor or per-channel
`weight_scale` / `weight_scale_inv`, and compressed-tensors `float-quantized` with `channel` or
`tensor` strategy); per-tensor scales become per-channel ones (the same value on every row), so
fused projections (q|k|v, gate|up) just concatenate. Block-wise scaled checkpoints
(`weight_block_size`, DeepSeek-style) are refused: they need a block-scaled GEMM.

What stays in the model's dtype: the embedding, lm_head, every norm and the biases.

`mm` is the one place a projection is applied. On the CPU (the reference path and CI) it runs the
same FP8 values dequantised; on a GPU kernels/fp8.py quantises the activations per token
(dynamic scales) and multiplies in FP8 (torch._scaled_mm, cuBLASLt; a Triton GEMV at one row)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "fp8")   # the same as services/worker/config.QUANTIZATIONS (a test checks)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class Fp8Weight:
    weight: torch.Tensor      # float8_e4m3fn [N, K], rows contiguous
    scale: torch.Tensor       # float32 [N]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def numel(self) -> int:
        return self.weight.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def rows(self, start: int, size: int) -> "Fp8Weight":
        return Fp8Weight(self.weight[start:start + size].contiguous(), self.scale[start:start + size].contiguous())

    def cols(self, start: int, size: int) -> "Fp8Weight":
        return Fp8Weight(self.weight[:, start:start + size].contiguous(), self.scale)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        return Fp8Weight(torch.cat([p.weight for p in parts]).contiguous(), torch.cat([p.scale for p in parts]))


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """bf16/fp32 [N, K] -> per-output-channel FP8 (amax / 448 per row; an all-zero row gets scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale.contiguous())


def from_checkpoint(weight: torch.Tensor, scale: torch.Tensor, inverse: bool = False) -> Fp8Weight:
    """A stored FP8 weight and its scale (a scalar, [N] or [N, 1]; `inverse`: the checkpoint
    stores 1 / scale, as `weight_scale_inv` does) -> Fp8Weight, without dequantising."""
    if weight.dtype != FP8:
        raise ValueError(f"an FP8 checkpoint weight must be float8_e4m3fn, got {weight.dtype}")
    n = weight.shape[0]
    s = scale.float().reshape(-1)
    if inverse:
        s = 1.0 / s
    if s.numel() == 1:
        s = s.expand(n)
    elif s.numel() != n:
        raise ValueError(f"an FP8 weight scale must be per tensor or per output channel ({n}), got "
                         f"{tuple(scale.shape)} (block-wise scales are not supported)")
    return Fp8Weight(weight.contiguous(), s.contiguous())


def mm(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain or an FP8 weight (the reference: FP8 values dequantised to x's dtype)."""
    if isinstance(w, Fp8Weight):
        return F.linear(x, w.dequantize(x.dtype), bias)
    return F.linear(x, w, bias)


def quantize_layers(layers, names=("qkv", "o", "gate_up", "down")) -> None:
    """In place: every named projection of every layer becomes an Fp8Weight (the bf16 tensor is
    dropped right away, so quantising a loaded model never holds two copies of more than one)."""
    for lw in layers:
        for name in names:
            w = getattr(lw, name)
            if not isinstance(w, Fp8Weight):
                setattr(lw, name, quantize_weight(w))
                del w


def checkpoint_fp8_scheme(config: dict) -> str | None:
    """How a checkpoint's config.json says its projections are stored: None (not quantised) or
    "fp8" (FP8 weights with per-tensor or per-channel scales). Other quantisations, and FP8 with
    block-wise scales, are refused with a message naming what is not served."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            raise ValueError(f"FP8 checkpoints with block-wise scales (weight_block_size "
                             f"{q['weight_block_size']}) are not served: only per-tensor and per-channel scales")
        return "fp8"
    if method == "compressed-tensors":
        for name, group in (q.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors group {name!r}: only 8-bit float weights are served, "
                                 f"got {w.get('num_bits')}-bit {w.get('type')}")
            if w.get("strategy") not in ("channel", "tensor"):
                raise ValueError(f"compressed-tensors group {name!r}: weight strategy {w.get('strategy')!r} is "
                                 "not served (channel or tensor only)")
        return "fp8"
    raise ValueError(f"quantization method {method!r} is not served (served: fp8, compressed-tensors float8)")
