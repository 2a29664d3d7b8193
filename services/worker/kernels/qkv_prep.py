"""One Triton kernel that takes the fused qkv projection to what attention needs: Qwen3's per-head
RMSNorm of q and k (optional), RoPE in place on the q and k heads, and this step's K and V stored
into the paged KV cache. It replaces three launches per decoder layer (torch q/k norm ops, `rope_`,
`write_kv`); at batch 1 a decode step is hundreds of tiny launches, each a few microseconds.

The heads of a qkv row are laid out back to back, q then k then v (`(nh + 2 kvh) * d` columns), so
head h always starts at column h * d. Grid: (tokens, head groups); a program loads BLOCK_H whole
heads as two [BLOCK_H, d/2] halves (RoPE pairs column i with i + d/2, so both halves are read before
anything is written), normalises and rotates the q/k rows, writes them back, and stores the k and v
rows into the cache. Arithmetic is fp32; every rounding matches the torch path it replaces.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.pdl import launch_args, wait_prior

from services.worker.kernels.attention import v_t_block_size, quantize_fp8_e4m3


@triton.jit
def _qkv_prep_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, cache_ptr, slot_ptr, rs_ptr, cs_ptr,
                     stride_t, stride_pos, stride_plane, stride_blk, stride_slot, stride_ch,
                     eps, k_scale, v_scale,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
                     IS_FP8: tl.constexpr, IN_SCALED: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = False, V_T: tl.constexpr = False,
                     UNIT_SCALES: tl.constexpr = False):
    wait_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    d_ok = dims < HALF
    is_q = heads < NUM_HEADS
    is_k = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS)
    is_v = (heads >= NUM_HEADS + NUM_KV_HEADS) & (heads < NUM_HEADS + 2 * NUM_KV_HEADS)
    rot = is_q | is_k
    ok = (rot | is_v)[:, None] & d_ok[None, :]

    base = qkv_ptr + t * stride_t + heads[:, None] * HEAD_DIM + dims[None, :]
    x1_st = tl.load(base, mask=ok, other=0.0)
    x2_st = tl.load(base + HALF, mask=ok, other=0.0)
    if IN_SCALED:
        # qkv holds an unscaled FP8 product (kernels/fp8.py): scale it by its token's and its
        # columns' scales, rounded to the storage dtype as the scaled product would have been.
        r = tl.load(rs_ptr + t)
        col = heads[:, None] * HEAD_DIM + dims[None, :]
        x1_st = (x1_st.to(tl.float32) * r * tl.load(cs_ptr + col, mask=ok, other=0.0)).to(qkv_ptr.dtype.element_ty)
        x2_st = (x2_st.to(tl.float32) * r * tl.load(cs_ptr + col + HALF, mask=ok, other=0.0)).to(qkv_ptr.dtype.element_ty)
    x1 = x1_st.to(tl.float32)
    x2 = x2_st.to(tl.float32)

    if HAS_NORM:
        # HF Qwen3RMSNorm per head: normalise in fp32, cast to the storage dtype, times the weight
        # (the product rounded to the storage dtype, as the torch ops assigned into qkv were).
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
        r = tl.rsqrt(var + eps)[:, None]
        qw1 = tl.load(qw_ptr + dims, mask=d_ok, other=0.0).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + dims, mask=d_ok, other=0.0).to(tl.float32)
        kw1 = tl.load(kw_ptr + dims, mask=d_ok, other=0.0).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + dims, mask=d_ok, other=0.0).to(tl.float32)
        w1 = tl.where(is_q[:, None], qw1[None, :], kw1[None, :])
        w2 = tl.where(is_q[:, None], qw2[None, :], kw2[None, :])
        n1 = (x1 * r).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w1
        n2 = (x2 * r).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w2
        n1 = n1.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        n2 = n2.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    else:
        n1 = x1
        n2 = x2

    # RoPE, HF rotate_half layout: cos/sin [max_len, 2 * HALF] hold the HALF frequencies twice.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_pos + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_pos + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    o1 = (n1 * cos - n2 * sin).to(qkv_ptr.dtype.element_ty)
    o2 = (n2 * cos + n1 * sin).to(qkv_ptr.dtype.element_ty)
    rot_ok = rot[:, None] & d_ok[None, :]
    tl.store(base, o1, mask=rot_ok)
    tl.store(base + HALF, o2, mask=rot_ok)
    if IN_SCALED:   # v stays in qkv too, scaled (attention reads K and V from the cache only)
        v_ok = is_v[:, None] & d_ok[None, :]
        tl.store(base, x1_st, mask=v_ok)
        tl.store(base + HALF, x2_st, mask=v_ok)

    # Cache: k rows take the rotated values (as left in qkv), v rows the loaded ones. Programs of
    # q heads only skip it (their stores would all be masked, but the fp8 rounding is not free).
    if tl.program_id(1) * BLOCK_H + BLOCK_H > NUM_HEADS:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c1 = tl.where(is_v[:, None], x1_st, o1).to(tl.float32)
        c2 = tl.where(is_v[:, None], x2_st, o2).to(tl.float32)
        if IS_FP8:
            # The one fp8 store rule of every KV write (x / scale saturated to ±448, rounded to even).
            scale = tl.where(is_v, v_scale, k_scale)[:, None]
            c1 = quantize_fp8_e4m3(c1, scale, UNIT_SCALES)
            c2 = quantize_fp8_e4m3(c2, scale, UNIT_SCALES)
        plane = is_v.to(tl.int64)
        kv_head = tl.where(is_v, heads - NUM_HEADS - NUM_KV_HEADS, heads - NUM_HEADS).to(tl.int64)
        row = (slot % BLOCK_SIZE) * stride_slot + kv_head * stride_ch                      # [BLOCK_H]
        step = tl.full([BLOCK_H], 1, tl.int64)
        if V_T:   # V per block as [kvh, d, BLOCK_SIZE] (kernels/attention.py): dim stride BLOCK_SIZE
            row = tl.where(is_v, kv_head * (HEAD_DIM * BLOCK_SIZE) + slot % BLOCK_SIZE, row)
            step = tl.where(is_v, BLOCK_SIZE, step)
        dst = (cache_ptr + (plane * stride_plane + (slot // BLOCK_SIZE) * stride_blk + row)[:, None]
               + dims[None, :] * step[:, None])
        store_kv = (is_k | is_v) & (heads * 0 + slot >= 0)   # slot -1: a padding row
        kv_ok = store_kv[:, None] & d_ok[None, :]
        tl.store(dst, c1.to(cache_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(dst + HALF * step[:, None], c2.to(cache_ptr.dtype.element_ty), mask=kv_ok)


def qkv_prep_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
              eps: float = 1e-6, k_scale: float = 1.0, v_scale: float = 1.0,
              heads_per_program: int | None = None,
              in_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """In place on qkv [T, >= (nh + 2 kvh) * d] (row stride free, head dim contiguous):
    optional per-head RMSNorm of q and k (weights [d], both or neither), then RoPE on q and k
    (positions [T] int; cos, sin fp32 [max_len, d], HF layout); then stores this step's k (rotated)
    and v into kv_cache [2, NB, BS, kvh, d] at slot_mapping [T] (negative: padding, not stored;
    V transposed per block where attention.v_transposed says so).
    An fp8 (e4m3fn) cache stores x / scale saturated to ±448 (kernels.attention.quantize_fp8_e4m3,
    the same rule as write_kv); other caches store x cast to their dtype.
    k_scale / v_scale are Python floats (fixed per model: a CUDA graph captures them as constants).
    in_scales (row [T, 1], col [(nh + 2 kvh) * d] float32): qkv holds an unscaled FP8 product and
    qkv * row * col is meant; every head is scaled in place first (v too).
    Returns qkv."""
    t = qkv.shape[0]
    if t == 0:
        return qkv
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    if qkv.shape[1] < (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, fewer than (nh + 2 kvh) * d")
    if tuple(kv_cache.shape[0:1] + kv_cache.shape[3:]) != (2, num_kv_heads, head_dim):
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} is not [2, NB, BS, "
                         f"{num_kv_heads}, {head_dim}]")
    assert qkv.stride(1) == 1 and kv_cache.stride(4) == 1
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    has_norm = q_norm is not None
    if has_norm:
        assert q_norm.is_contiguous() and k_norm.is_contiguous()
    total = num_heads + 2 * num_kv_heads
    half = head_dim // 2
    # ~2K elements per program: big enough to stream well, small enough that a single decode
    # token still spreads over several SMs (Llama-3-8B: 48 heads of 128 -> 3 programs a token).
    # Half that where V is stored transposed: its byte-strided stores are the slow part, and more
    # programs share them (H100, 8B shape, bench/gpu_prefill_parts.py: 8 heads a program 134 us
    # at 8,192 tokens against 227 with 16, 9.2 against 14.3 at 256).
    v_t = v_t_block_size(kv_cache) > 0
    elems = 1024 if v_t else 2048
    block_h = heads_per_program or max(1, elems // triton.next_power_of_2(head_dim))
    block_h = min(triton.next_power_of_2(block_h), triton.next_power_of_2(total))
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    wq = q_norm if has_norm else qkv  # placeholder pointers, never read without HAS_NORM
    wk = k_norm if has_norm else qkv
    rs, cs = in_scales if in_scales is not None else (qkv, qkv)
    grid = (t, triton.cdiv(total, block_h))
    _qkv_prep_kernel[grid](qkv, positions, cos, sin, wq, wk, kv_cache, slot_mapping, rs, cs,
                           qkv.stride(0), cos.stride(0), kv_cache.stride(0), kv_cache.stride(1),
                           kv_cache.stride(2), kv_cache.stride(3),
                           float(eps), float(k_scale), float(v_scale),
                           NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                           HALF=half, BLOCK_SIZE=kv_cache.shape[2], HAS_NORM=has_norm,
                           IS_FP8=is_fp8, IN_SCALED=in_scales is not None, BLOCK_H=block_h,
                           V_T=v_t, UNIT_SCALES=k_scale == 1.0 and v_scale == 1.0,
                           BLOCK_HALF=triton.next_power_of_2(half), num_warps=4, **launch_args(qkv))
    return qkv
