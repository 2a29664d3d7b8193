"""y = x @ W^T for a single row x (batch-1 decode): a Triton GEMV that streams W once.

At M = 1 a decode step is weight streaming. cuBLAS splits K for the narrow projections (o: 4096 x
4096, down: 4096 x 14336 of Llama-3-8B) and adds a reduction kernel after each; this kernel gives
every program BLOCK_N whole rows instead (no split, no second launch) and reaches cuBLAS's
bandwidth or better on the H200 (bench/results/gpu_gemv_sweep.json: lm_head 4.29 vs 4.13 TB/s,
down 3.36 vs 3.29, o 1.95 vs 1.86). Only M = 1 takes this path: from 2 rows on, cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.kernels.pdl import launch_args, wait_prior

# (BLOCK_N, BLOCK_K, num_warps, num_stages) from the H200 sweep, by K.
_CONFIGS = {4096: (16, 512, 8, 2), 14336: (16, 1024, 8, 4)}
_DEFAULT = (16, 256, 4, 4)
ENABLED = True   # bench/gpu_decode.py turns it off to time cuBLAS in the same run


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_wn,
                HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_PDL: tl.constexpr = False, PEEL_FIRST: tl.constexpr = False):
    """y = x @ W^T (x one row); HAS_SCALE: W holds FP8 values, row n scaled by s[n] (kernels/fp8.py).
    With PDL the first weight tile is loaded before waiting for the previous kernel (no kernel
    writes weights), so the stream starts while that kernel finishes; x is read after the wait.
    PEEL_FIRST: that first iteration apart without PDL (the CPU tests run it under the interpreter,
    which has no grid-dependency instructions)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    start = 0
    if USE_PDL or PEEL_FIRST:
        rk = tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wait_prior(USE_PDL)
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_SCALE:
        y *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K], w [N, K] (rows contiguous), bias [N] or None -> [1, N] in x's dtype."""
    n, k = w.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config or _CONFIGS.get(k, _DEFAULT)
    bk = min(bk, triton.next_power_of_2(k))
    gemv_kernel[(triton.cdiv(n, bn),)](x, w, w, bias if bias is not None else w, y, n, k, w.stride(0),
                                       HAS_SCALE=False, HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
                                       num_warps=warps, num_stages=stages, **launch_args(x))
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with one-row inputs on the GPU through `gemv` (FP8 weights: kernels/fp8.py)."""
    if ENABLED and x.shape[0] == 1 and x.is_cuda and x.stride(1) == 1 and w.stride(1) == 1:
        return gemv(x, w, bias)
    return F.linear(x, w, bias)
