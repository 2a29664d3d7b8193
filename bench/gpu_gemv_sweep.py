"""Batch-1 decode is weight streaming: does a Triton GEMV beat cuBLAS (torch F.linear) on the
Llama-3.1-8B projection shapes at M = 1? Times both on rotated weight copies (so L2 never holds
a matrix) and reports bytes/s against the device copy bandwidth measured in the same run.

  python3 bench/gpu_gemv_sweep.py --out bench/results/gpu_gemv_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(x, w, y, bn, bk, warps, stages):
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=warps, num_stages=stages)


def timed(fn, copies: int, iters: int = 30) -> float:
    """Median ms of fn(i) over rotating copies."""
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    out = []
    for it in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in range(copies):
            fn(c)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / copies)
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_gemv_sweep.json")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    n = 2 ** 30
    a, b = torch.empty(n, device=dev, dtype=dt), torch.empty(n, device=dev, dtype=dt)
    ms = timed(lambda i: b.copy_(a), 1, 10)
    copy_bw = 2 * n * 2 / (ms / 1e3)
    del a, b
    res = {"copy_bytes_per_s": copy_bw, "shapes": {}}
    configs = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4)))
    for name, (nn, kk) in SHAPES.items():
        copies = max(2, int(256e6 // (nn * kk * 2)) + 1)
        ws = [torch.randn(nn, kk, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, kk, device=dev, dtype=dt)
        y = torch.empty(nn, device=dev, dtype=dt)
        ref = torch.nn.functional.linear(x, ws[0])[0]
        nbytes = nn * kk * 2
        cub = timed(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
        row = {"cublas_ms": cub, "cublas_bw": nbytes / (cub / 1e3), "triton": []}
        for bn, bk, warps, stages in configs:
            try:
                gemv(x, ws[0], y, bn, bk, warps, stages)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                t = timed(lambda i: gemv(x, ws[i], y, bn, bk, warps, stages), copies)
                row["triton"].append({"bn": bn, "bk": bk, "warps": warps, "stages": stages, "ms": t,
                                      "bw": nbytes / (t / 1e3), "rel_err": err})
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory / registers
                row["triton"].append({"bn": bn, "bk": bk, "warps": warps, "stages": stages, "error": str(exc)[:120]})
        ok = [r for r in row["triton"] if "ms" in r and r["rel_err"] < 1e-2]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        row["best_triton"] = best
        row["best_ratio_to_cublas"] = best["ms"] / cub if best else None
        res["shapes"][name] = row
        print(name, f"cublas {cub * 1e3:.1f} us ({row['cublas_bw'] / 1e12:.2f} TB/s)",
              f"best triton {best['ms'] * 1e3:.1f} us ({best['bw'] / 1e12:.2f} TB/s) {best}" if best else "", flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
