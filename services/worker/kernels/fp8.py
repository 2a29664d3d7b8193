"""FP8 projections on the GPU (--quantization fp8; the weights: models/fp8.py).

- One row (batch-1 decode is weight streaming): a Triton GEMV that reads the FP8 weight once,
  multiplies with the bf16 activation in fp32 and applies the row scales at the end: half the
  bytes of the bf16 GEMV, and no activation rounding. Tiles by shape (`gemv_config`).
- More rows, in the model's forward (models/llama_triton.py): the producer of a projection's input
  (the residual-add RMSNorm, SiLU·mul) quantises it per token as it writes it, `unscaled_mm`
  multiplies on the FP8 tensor cores through cuBLASLt with unit scales, and the consumer (the
  q/k/v prep, the next norm, SiLU·mul) applies the token's and the channel's scales as it reads
  the product. cuBLASLt's row-wise-scaled FP8 GEMMs pick slow tiles below ~1k rows (H200, 8B
  shapes, bench/results/gpu_fp8_kernels.json: qkv at 2 rows 18.0 us row-wise vs 9.6 unit-scaled,
  down at 64 rows 36.8 vs 18.4, gate_up at 256 rows 56.4 vs 53.0).
- `fp8_linear` is the whole projection in one call (`quantize_rows`, then torch._scaled_mm with
  row-wise scales, bias included): for projections with a bias, and for the row-parallel o and
  down of tensor parallelism, whose per-rank products must be scaled before the all-reduce.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.pdl import launch_args, wait_prior

from services.worker.kernels.attention import quantize_fp8_e4m3
from services.worker.kernels.gemv import gemv_kernel
from services.worker.models.fp8 import FP8, Fp8Weight


@triton.jit
def row_scale(amax):
    """A per-token FP8 scale from the row's absolute maximum: amax / 448, 1 for an all-zero row."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)   # as torch's amax / 448, bit for bit


# Per-token activations are quantised as x * (1 / scale), the reciprocal computed once per row, as
# vLLM's dynamic per-token quantisers do; False: x / scale, an IEEE division per value (a
# reciprocal, fix-ups and a slow-path branch each in the SASS). For A/B runs (bench/gpu_fp8.py mode
# "divquant"); the KV cache's stores keep their division (kernels/attention.quantize_fp8_e4m3).
RECIPROCAL_QUANT = True


@triton.jit
def inverse_scale(scale):
    """1 / scale, correctly rounded (IEEE, as torch's `1 / s`)."""
    return tl.math.div_rn(1.0, scale)


@triton.jit
def quantize_act(v, scale, inv, RCP: tl.constexpr):
    """A per-token activation's e4m3 values (kernels/attention.quantize_fp8_e4m3's saturation and
    rounding) of `v * inv` (RCP; inv = inverse_scale(scale); the torch twin is
    `(x * (1 / s)).clamp(-448, 448).to(fp8)`), else of `v / scale`."""
    if RCP:
        return quantize_fp8_e4m3(v * inv, 1.0, UNIT_SCALE=True)
    return quantize_fp8_e4m3(v, scale)


@triton.jit
def quantize_row(v, q_ptr, s_ptr, row, cols, ok, RCP: tl.constexpr):
    """Per-token FP8 of one row held in registers (fp32): its scale into s_ptr[row], the e4m3
    values into q_ptr + cols (`quantize_act`)."""
    scale = row_scale(tl.max(tl.where(ok, tl.abs(v), 0.0), 0))
    tl.store(s_ptr + row, scale)
    q = quantize_act(v, scale, inverse_scale(scale), RCP)
    tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                       USE_PDL: tl.constexpr = False, RCP: tl.constexpr = True):
    wait_prior(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:   # the whole row in registers: one read
        rk = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        quantize_row(x, q_ptr + row * stride_q, s_ptr, row, rk, rk < K, RCP)
        return
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, 0))
    tl.store(s_ptr + row, scale)
    inv = inverse_scale(scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        q = quantize_act(x, scale, inv, RCP)
        tl.store(q_ptr + row * stride_q + rk, q.to(q_ptr.dtype.element_ty), mask=rk < K)


ONE_PASS_MAX_K = 16384   # rows up to this long are read once (held in registers), longer ones twice


def quantize_rows(x: torch.Tensor, one_pass: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M, 1]), x ~= q * scale: scale =
    the row's absolute maximum / 448, q = x * (1 / scale) rounded (`quantize_act`, RECIPROCAL_QUANT)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        one = one_pass and k <= ONE_PASS_MAX_K
        block = triton.next_power_of_2(k) if one else min(1024, triton.next_power_of_2(k))
        _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block, ONE_PASS=one, RCP=RECIPROCAL_QUANT,
                                 num_warps=min(16, max(4, block // 512)) if one else 4, **launch_args(x))
    return q, s


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the FP8 GEMV, from the H200 sweep at the 8B
    shapes (bench/results/gpu_fp8_kernels.json, L2-cold, in CUDA graphs): narrow outputs (o, down:
    N = 4096) want more, thinner programs (o 7.1 us vs 7.9, down 17.8 vs 22.2 with 16 x 512);
    wide ones (qkv, gate_up) 16 rows of 512 (gate_up 3.5 TB/s)."""
    return (8, 1024, 4, 2) if n <= 4096 else (16, 512, 8, 2)


def gemv_fp8(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] (bf16), w FP8 [N, K] -> [1, N] in x's dtype."""
    n, k = w.weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config or gemv_config(n, k)
    bk = min(bk, triton.next_power_of_2(k))
    gemv_kernel[(triton.cdiv(n, bn),)](x, w.weight, w.scale, bias if bias is not None else w.scale, y, n, k,
                                       w.weight.stride(0), HAS_SCALE=True, HAS_BIAS=bias is not None, BLOCK_N=bn,
                                       BLOCK_K=bk, num_warps=warps, num_stages=stages, **launch_args(x))
    return y


W8A8_MIN_ROWS = 2   # from this many rows on, activations are quantised too (bench/gpu_fp8.py measures)
# cuBLASLt's FP8 fast accumulation (no periodic promotion of the tensor cores' partial sums to
# fp32 registers), as vLLM's CUTLASS FP8 GEMMs on Hopper (their FP8FastAccum schedules) and
# TensorRT-LLM run. bench/gpu_prefill_parts.py and bench/gpu_fp8.py (mode "slowacc") time it
# against full accumulation; tests/gpu/test_fp8_gpu.py checks the error at full shapes.
FAST_ACCUM = True

_UNIT: dict[torch.device, torch.Tensor] = {}


def _unit(device: torch.device) -> torch.Tensor:
    one = _UNIT.get(device)
    if one is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # A tensor made inside a capture holds nothing until the graph runs.
            raise RuntimeError("unscaled_mm must run once eagerly before a CUDA graph captures it")
        one = _UNIT[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def unscaled_mm(a: tuple[torch.Tensor, torch.Tensor], w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """a = (e4m3 [M, K], its per-token scales [M, 1]), w FP8 [N, K] -> sum_k a[m, k] * w[n, k] in
    out_dtype, unscaled: the real product is that times a's scale[m] and w.scale[n], which the
    consumer applies (the `in_scales` of kernels/elementwise.py and qkv_prep.py). The products
    of e4m3 values accumulate exactly in fp32; bf16 holds the sum's range (448^2 * K)."""
    q = a[0]
    return torch._scaled_mm(q, w.weight.t(), scale_a=_unit(q.device), scale_b=_unit(q.device), out_dtype=out_dtype,
                            use_fast_accum=FAST_ACCUM)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W in FP8: the GEMV at one row, else per-token FP8 x cuBLASLt."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if x.shape[0] == 1:
        return gemv_fp8(x, w, bias)
    if x.shape[0] < W8A8_MIN_ROWS:    # weight-only: bf16 activations, the weight dequantised
        return torch.nn.functional.linear(x, w.dequantize(x.dtype), bias)
    q, s = quantize_rows(x)
    return torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w.scale[None, :], bias=bias, out_dtype=x.dtype,
                            use_fast_accum=FAST_ACCUM)
