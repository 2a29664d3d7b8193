"""A Triton GEMM for FP8 weights at decode-sized M, measured against cuBLASLt by bench/gpu_fp8_kernels.py
(not served: the unit-scaled cuBLASLt GEMMs with the scales in the neighbouring kernels were as
fast or faster at every decode size, docs/gpu.md; this kernel stays here as the sweep's peer).

y[M, N] = x[M, K] @ W[N, K]^T, W in e4m3 with one float32 scale per output channel (models/fp8.py):

- A_FP8: x is e4m3 with one scale per row (per-token activations, kernels/fp8.quantize_rows or a
  producer kernel that quantises as it writes), multiplied on the FP8 tensor cores; both scales
  are applied to the fp32 accumulator at the end.
- not A_FP8 (W8A16): x stays in its dtype and each weight tile is widened in registers; only the
  weight scale is applied.
- SWAP_AB: the tile is [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, so the weight's rows run along
  the MMA's long dimension and a handful of token rows along its short one (a decode step of 8
  rows fills a 64 x 16 MMA instead of padding 8 rows to 64).

The weight tile is read once per program; programs are ordered in groups of GROUP_M row tiles so
that those sharing a weight tile run together.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8w_gemm_kernel(a_ptr, w_ptr, ws_ptr, as_ptr, b_ptr, c_ptr, M, N, K,
                      stride_am, stride_wn, stride_cm,
                      A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if not A_FP8:
            w = w.to(a.dtype)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    if SWAP_AB:
        acc = acc * ws[:, None]
        if A_FP8:
            acc = acc * tl.load(as_ptr + rm, mask=m_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + rm[None, :].to(tl.int64) * stride_cm + rn[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        acc = acc * ws[None, :]
        if A_FP8:
            acc = acc * tl.load(as_ptr + rm, mask=m_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB) by the largest M it serves.
GemmConfig = tuple[int, int, int, int, int, bool]


def fp8w_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor | None,
              bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemmConfig) -> torch.Tensor:
    """a [M, K] (e4m3 with a_scale [M] or [M, 1], or a float dtype with a_scale None), w e4m3 [N, K],
    w_scale float32 [N] -> [M, N] in out_dtype."""
    m, k = a.shape
    n = w.shape[0]
    assert w.shape[1] == k and a.stride(1) == 1 and w.stride(1) == 1
    a_fp8 = a_scale is not None
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    bm, bn, bk, warps, stages, swap = config
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8w_gemm_kernel[grid](a, w, w_scale, a_scale if a_fp8 else w_scale, bias if bias is not None else w_scale, c,
                            m, n, k, a.stride(0), w.stride(0), c.stride(0),
                            A_FP8=a_fp8, HAS_BIAS=bias is not None, SWAP_AB=swap, EVEN_K=k % bk == 0,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return c
