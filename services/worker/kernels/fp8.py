"""FP8 projections on the GPU (--quantization fp8; the weights: models/fp8.py).

- One row (batch-1 decode is weight streaming): a Triton GEMV that reads the FP8 weight once,
  multiplies with the bf16 activation in fp32 and applies the row scales at the end: half the
  bytes of the bf16 GEMV, and no activation rounding.
- More rows: the activations are quantised per token (`quantize_rows`: one kernel computes each
  row's absolute maximum and writes e4m3 values and the row's scale, amax / 448), then
  torch._scaled_mm (cuBLASLt FP8 with row-wise scales: scale_a [M, 1], scale_b [1, N]) writes the
  bf16 output, bias included.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.gemv import gemv_kernel
from services.worker.models.fp8 import FP8, FP8_MAX, Fp8Weight

GEMV_CONFIG = (16, 512, 8, 2)   # BLOCK_N, BLOCK_K, num_warps, num_stages


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still in fp32: the
    cast after it is exact. Triton's interpreter (CI) rounds fp32 -> e4m3 wrongly where the
    rounding carries into the exponent (1.97 -> 1.0), so the kernel never leaves the rounding
    to the cast. The classic trick: adding and subtracting 1.5 * 2^(23 + e) rounds to a multiple
    of 2^e; e = the value's exponent - 3 (3 mantissa bits), at least -9 (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3
    magic = (((step_exp + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX_C: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.max(amax, 0)
    scale = tl.where(m > 0, m / FP8_MAX_C, 1.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        # div_rn: IEEE division (Triton's `/` may be approximate on the GPU), as torch's x / s.
        q = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C))
        tl.store(q_ptr + row * stride_q + rk, q.to(q_ptr.dtype.element_ty), mask=rk < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M, 1]), x ~= q * scale."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX_C=FP8_MAX,
                                 BLOCK_K=min(1024, triton.next_power_of_2(k)))
    return q, s


def gemv_fp8(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] (bf16), w FP8 [N, K] -> [1, N] in x's dtype."""
    n, k = w.weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config or GEMV_CONFIG
    bk = min(bk, triton.next_power_of_2(k))
    gemv_kernel[(triton.cdiv(n, bn),)](x, w.weight, w.scale, bias if bias is not None else w.scale, y, n, k,
                                       w.weight.stride(0), HAS_SCALE=True, HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
                                            num_warps=warps, num_stages=stages)
    return y


W8A8_MIN_ROWS = 2   # from this many rows on, activations are quantised too (bench/gpu_fp8.py measures)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W in FP8: the GEMV at one row, else per-token FP8 x cuBLASLt."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if x.shape[0] == 1:
        return gemv_fp8(x, w, bias)
    if x.shape[0] < W8A8_MIN_ROWS:    # weight-only: bf16 activations, the weight dequantised
        return torch.nn.functional.linear(x, w.dequantize(x.dtype), bias)
    q, s = quantize_rows(x)
    return torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w.scale[None, :], bias=bias, out_dtype=x.dtype)
