"""Programmatic dependent launch (PDL, compute capability >= 9.0) for the forward's Triton kernels.

A decode step at batch 1 is ~320 short kernels in one CUDA graph; between two of them the GPU
drains the first and only then schedules the second's programs. Launched with PDL
(`launch_pdl=True`), a kernel's programs may be scheduled while the one before it still runs: each
program first waits for the previous grid to complete with its writes visible (`gdc_wait`), then
lets the next kernel be scheduled (`gdc_launch_dependents`). Nothing is read or written before the
wait, so a kernel behind a PDL one sees exactly what it would without PDL, and a kernel that is not
launched with PDL (cuBLAS, torch) orders as any stream launch does.

Only launches of at most MAX_ROWS rows (tokens) use it. On the H200 (8B shape, FP8 weights, CUDA
graphs, `python3 bench/gpu_fp8.py --weights fp8 --modes fused,nopdl --offline ""`,
bench/results/gpu_fp8_pdl.json) PDL on every launch made the decode step at batch 1 4.6% faster
(2.99 -> 2.85 ms, bf16 KV; 3.02 -> 2.88, fp8 KV), batch 64 2.5% slower (6.50 -> 6.66) and batch 256
the same (17.30 / 17.32). The one-row GEMV (gemv.py) also loads its first weight tile before the
wait, the one read allowed there (no kernel writes weights): b1 2.82 / 2.85 ms
(gpu_fp8_pdl_prefetch.json).

Off on CPUs and under Triton's interpreter (the constexpr is False and no launch option is passed),
on GPUs older than Hopper, and with MESHLLM_PDL=0 (or `ENABLED = False` before the CUDA graphs are
captured: bench/gpu_fp8.py --modes nopdl times both in one run).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("MESHLLM_PDL", "1") != "0"
MAX_ROWS = 1
_CAPABLE: dict[int, bool] = {}


def enabled(t: torch.Tensor) -> bool:
    """May a kernel over `t` (its rows: t's first dimension) be launched with PDL?"""
    if not ENABLED or not t.is_cuda or t.shape[0] > MAX_ROWS or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(idx)
    if ok is None:
        ok = _CAPABLE[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments of a launch: the kernel's USE_PDL constexpr, and the launch option."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(t) else {"USE_PDL": False}


@triton.jit
def wait_prior(USE_PDL: tl.constexpr):
    """First statement of every forward kernel: with PDL, wait for the previous kernel's writes,
    then let the next kernel's programs be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
