"""Row-wise Triton kernels of the decoder layer: fused residual-add + RMSNorm, rotary embedding
(in place on the fused qkv), SiLU·mul. Each one reads its input once and writes its output once;
the arithmetic is fp32 whatever the storage dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps,
                         stride_x, stride_res, stride_out,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # residual += x, rounded to the storage dtype as torch's `h = h + x` would be.
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        x_st = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, x_st, mask=ok)
        x = x_st.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    y = x * tl.rsqrt(var + eps)
    # HF LlamaRMSNorm: normalise in fp32, cast to the input dtype, then scale by the weight.
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]. Without residual: rms_norm(x) * w. With residual [T, H]: residual += x in place,
    then returns rms_norm(residual) * w (the pre-norm decoder's `h = h + x; x = norm(h)`)."""
    t, h = x.shape
    if out is None:
        out = torch.empty_like(x)
    if t == 0:
        return out
    res = residual if residual is not None else x
    assert x.stride(1) == 1 and res.stride(1) == 1 and out.stride(1) == 1
    block = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(t,)](x, res, weight, out, h, eps, x.stride(0), res.stride(0), out.stride(0),
                               HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=min(16, max(1, block // 256)))
    return out


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_pos,
                 NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
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
                       BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return qkv


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up: [T, I]."""
    t, two_i = x.shape
    i = two_i // 2
    if out is None:
        out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    assert x.stride(1) == 1 and out.stride(1) == 1
    block = min(block, triton.next_power_of_2(i))
    _silu_mul_kernel[(t, triton.cdiv(i, block))](x, out, i, x.stride(0), out.stride(0), BLOCK=block,
                                                 num_warps=4)
    return out
