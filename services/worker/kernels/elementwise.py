"""Row-wise Triton kernels of the decoder layer: fused residual-add + RMSNorm, rotary embedding
(in place on the fused qkv), SiLU·mul. Each one reads its input once and writes its output once;
the arithmetic is fp32 whatever the storage dtype (SiLU's exponential and reciprocal on a GPU are
the hardware's approximations, `_silu`).

With FP8 weights (kernels/fp8.py) the norm and SiLU·mul take the unscaled FP8 product in and apply
its per-token and per-channel scales as they read it (`in_scales`), and quantise their output per
token for the next projection as they write it (`fp8_out`): the GEMM between them needs no scaling
epilogue and no separate quantiser pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.pdl import launch_args, wait_prior

from services.worker.kernels.attention import _HW_FP8_CVT as _FAST_MATH   # a GPU, not the interpreter

from services.worker.kernels import fp8 as fp8_kernels
from services.worker.kernels.fp8 import inverse_scale, quantize_act, quantize_row, row_scale
from services.worker.models.fp8 import FP8


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, rs_ptr, cs_ptr, qs_ptr, n_cols, eps,
                         stride_x, stride_res, stride_out,
                         HAS_RESIDUAL: tl.constexpr, IN_SCALED: tl.constexpr, OUT_FP8: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False, RCP: tl.constexpr = True):
    wait_prior(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if IN_SCALED:
        # x is an unscaled FP8 product (kernels/fp8.py): times its row and column scales, rounded
        # to the model's dtype as the scaled product would have been stored.
        x = x * tl.load(rs_ptr + row) * tl.load(cs_ptr + cols, mask=ok, other=0.0)
        x = x.to(res_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        # residual += x, rounded to the storage dtype as torch's `h = h + x` would be.
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        x_st = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, x_st, mask=ok)
        x = x_st.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    y = x * tl.rsqrt(var + eps)
    # HF LlamaRMSNorm: normalise in fp32, cast to the input dtype, then scale by the weight.
    y = y.to(res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if OUT_FP8:   # the next projection's per-token FP8 input, quantised here instead of re-read
        y = (y * w).to(res_ptr.dtype.element_ty).to(tl.float32)
        quantize_row(y, out_ptr + row * stride_out, qs_ptr, row, cols, ok, RCP)
    else:
        tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 fp8_out: bool = False):
    """x: [T, H]. Without residual: rms_norm(x) * w. With residual [T, H]: residual += x in place,
    then returns rms_norm(residual) * w (the pre-norm decoder's `h = h + x; x = norm(h)`).

    in_scales (row [T, 1], col [H] float32): x is an unscaled FP8 product, x * row * col is meant.
    fp8_out: returns (e4m3 [T, H], float32 scales [T, 1]), the output quantised per token (what
    kernels/fp8.quantize_rows would make of the bf16 output)."""
    t, h = x.shape
    res = residual if residual is not None else x
    if fp8_out:
        out = torch.empty(t, h, dtype=FP8, device=x.device)
        qs = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    elif out is None:
        out = torch.empty_like(x)
    if t == 0:
        return (out, qs) if fp8_out else out
    assert x.stride(1) == 1 and res.stride(1) == 1 and out.stride(1) == 1
    block = triton.next_power_of_2(h)
    rs, cs = in_scales if in_scales is not None else (weight, weight)
    _add_rms_norm_kernel[(t,)](x, res, weight, out, rs, cs, qs if fp8_out else weight, h, eps,
                               x.stride(0), res.stride(0), out.stride(0),
                               HAS_RESIDUAL=residual is not None, IN_SCALED=in_scales is not None,
                               OUT_FP8=fp8_out, BLOCK=block, RCP=fp8_kernels.RECIPROCAL_QUANT,
                               num_warps=min(16, max(1, block // 256)), **launch_args(x))
    return (out, qs) if fp8_out else out


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_pos,
                 NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    d_ok = dims < HALF
    ok = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    # cos/sin tables [max_len, 2 * HALF] in HF layout: the HALF frequencies twice.
    cos = tl.load(cos_ptr + pos * stride_pos + dims, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_pos + dims, mask=d_ok, other=0.0).to(tl.float32)
    base = qkv_ptr + t * stride_t + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base, o1.to(qkv_ptr.dtype.element_ty), mask=ok)
    tl.store(base + HALF, o2.to(qkv_ptr.dtype.element_ty), mask=ok)


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          num_rot_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate, in place, the first `num_rot_heads` heads of each row of qkv [T, >= heads * d]
    (the q then k heads of the fused projection; v follows and is left alone).
    positions: [T] int; cos, sin: [max_len, d] (fp32 keeps Llama 3's scaled frequencies exact)."""
    t = qkv.shape[0]
    if t == 0:
        return qkv
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    half = head_dim // 2
    _rope_kernel[(t,)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0),
                       NUM_HEADS=num_rot_heads, HALF=half,
                       BLOCK_H=triton.next_power_of_2(num_rot_heads),
                       BLOCK_HALF=triton.next_power_of_2(half), num_warps=4, **launch_args(qkv))
    return qkv


@triton.jit
def _silu_tile(x_ptr, rs_ptr, cs_ptr, rows, stride_x, n_cols, cols, ok, IN_SCALED: tl.constexpr, FAST: tl.constexpr):
    """silu(gate) * up of rows `rows` [R] x columns `cols` [C] -> [R, C] fp32. IN_SCALED: x is an
    unscaled FP8 product, scaled here and rounded to x's dtype as the stored product would have
    been (the column scales loaded once for all R rows)."""
    at = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(at + n_cols, mask=ok, other=0.0).to(tl.float32)
    if IN_SCALED:
        r = tl.load(rs_ptr + rows, mask=rows >= 0, other=0.0)[:, None]
        c_ok = cols < n_cols
        gate = (gate * r * tl.load(cs_ptr + cols, mask=c_ok, other=0.0)[None, :]).to(x_ptr.dtype.element_ty)
        up = (up * r * tl.load(cs_ptr + n_cols + cols, mask=c_ok, other=0.0)[None, :]).to(x_ptr.dtype.element_ty)
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
    return _silu(gate, FAST) * up


@triton.jit
def _silu(g, FAST: tl.constexpr):
    """g * sigmoid(g) in fp32. On a GPU the exponential and the reciprocal are single MUFU
    instructions (ex2 / rcp .approx.ftz: ~2 ulp, no denormal or range fix-ups); the interpreter
    computes g / (1 + exp(-g))."""
    if FAST and _FAST_MATH:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return g * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e],
                                             dtype=tl.float32, is_pure=True, pack=1)
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, rs_ptr, cs_ptr, qs_ptr, n_rows, n_cols, stride_x, stride_out,
                     IN_SCALED: tl.constexpr, OUT_FP8: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = False, WHOLE_ROW: tl.constexpr = False, ROWS: tl.constexpr = 1,
                     FAST: tl.constexpr = True, RCP: tl.constexpr = True):
    wait_prior(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r_ok = rows < n_rows
    rows = tl.where(r_ok, rows, -1)          # a row past the end: masked everywhere, no scale load
    if OUT_FP8 and WHOLE_ROW:
        # The whole row in one pass (enough warps that it fits in registers): its maximum, then
        # the same values quantised with it.
        cols = tl.arange(0, BLOCK)
        ok = r_ok[:, None] & (cols < n_cols)[None, :]
        y = _silu_tile(x_ptr, rs_ptr, cs_ptr, rows, stride_x, n_cols, cols, ok, IN_SCALED, FAST)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.where(ok, tl.abs(y), 0.0), 1))
        tl.store(qs_ptr + rows, scale, mask=r_ok)
        q = quantize_act(y, scale[:, None], inverse_scale(scale)[:, None], RCP)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=ok)
    elif OUT_FP8:
        # ROWS rows a program, in chunks: their absolute maxima first, then the chunks again (from
        # L2), quantised with them. Several rows share each chunk's column scales.
        amax = tl.zeros([ROWS, BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = r_ok[:, None] & (cols < n_cols)[None, :]
            y = _silu_tile(x_ptr, rs_ptr, cs_ptr, rows, stride_x, n_cols, cols, ok, IN_SCALED, FAST)
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
            amax = tl.maximum(amax, tl.where(ok, tl.abs(y), 0.0))
        scale = row_scale(tl.max(amax, 1))
        tl.store(qs_ptr + rows, scale, mask=r_ok)
        inv = inverse_scale(scale)[:, None]
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = r_ok[:, None] & (cols < n_cols)[None, :]
            y = _silu_tile(x_ptr, rs_ptr, cs_ptr, rows, stride_x, n_cols, cols, ok, IN_SCALED, FAST)
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
            q = quantize_act(y, scale[:, None], inv, RCP)
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = r_ok[:, None] & (cols < n_cols)[None, :]
        y = _silu_tile(x_ptr, rs_ptr, cs_ptr, rows, stride_x, n_cols, cols, ok, IN_SCALED, FAST)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


# fp8_out: (BLOCK, num_warps[, ROWS]) of the program; BLOCK >= the row's width holds a row whole.
# H100, 8B shape (14,336 wide, bench/gpu_silu_sweep.py -> bench/results/gpu_silu_sweep.json):
# chunks of 2,048 with 16 warps 17.4 us at 256 rows and 10.2 at 64, against 19.3 / 12.4 with 8
# warps; the row held whole, 32 warps: 18.7 / 9.4. At prefill sizes (bench/gpu_prefill_parts.py
# -> bench/results/gpu_prefill_parts_h100.json) too: 391 us at 8,192 rows (1.63x its floor), 60 at
# 1,024. Several rows a program, which share each chunk's column scales, were slower at every size
# (8,192 rows: 479 us with 2 rows a program, 598 with 4; 1,024 rows: 79 / 93), though one row a
# program took 443 us with the scales against 293 without them.
# SiLU's exponential and reciprocal as single MUFU instructions on a GPU (`_silu`); False: exp and
# a division with their denormal and range fix-ups (for A/B runs: bench/gpu_fp8.py mode "exactsilu").
FAST_SILU = True
SILU_FP8_CONFIG: tuple[int, ...] | None = None   # None: chunks of 2,048 with 16 warps, one row a program


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024,
             in_scales: tuple[torch.Tensor, torch.Tensor] | None = None, fp8_out: bool = False,
             fp8_config: tuple[int, ...] | None = None):
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I].

    in_scales (row [T, 1], col [2I] float32): x is an unscaled FP8 product (x * row * col meant).
    fp8_out: returns (e4m3 [T, I], float32 scales [T, 1]), quantised per token (a program takes
    ROWS rows and walks them twice: their maxima, then the values; fp8_config (BLOCK, warps[,
    ROWS]), else SILU_FP8_CONFIG's)."""
    t, two_i = x.shape
    i = two_i // 2
    if fp8_out:
        out = torch.empty(t, i, dtype=FP8, device=x.device)
        qs = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    elif out is None:
        out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    if t == 0:
        return (out, qs) if fp8_out else out
    assert x.stride(1) == 1 and out.stride(1) == 1
    warps, rows = 4, 1
    if fp8_out:
        cfg = fp8_config or SILU_FP8_CONFIG or (2048, 16)
        block, warps, rows = cfg[0], cfg[1], cfg[2] if len(cfg) > 2 else 1
    block = min(block, triton.next_power_of_2(i))
    rs, cs = in_scales if in_scales is not None else (x, x)
    grid = (triton.cdiv(t, rows), 1) if fp8_out else (t, triton.cdiv(i, block))
    _silu_mul_kernel[grid](x, out, rs, cs, qs if fp8_out else x, t, i, x.stride(0), out.stride(0),
                           IN_SCALED=in_scales is not None, OUT_FP8=fp8_out, BLOCK=block,
                           WHOLE_ROW=fp8_out and block >= i, ROWS=rows, FAST=FAST_SILU,
                           RCP=fp8_kernels.RECIPROCAL_QUANT, num_warps=warps, **launch_args(x))
    return (out, qs) if fp8_out else out
