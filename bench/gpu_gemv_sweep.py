"""Batch-1 decode is weight streaming: does the Triton GEMV (services/worker/kernels/gemv.py) beat
cuBLAS (torch F.linear) on the Llama-3.1-8B projection shapes at M = 1, and with which tiles?
Times both on rotated weight copies (so L2 never holds a matrix) and reports bytes/s against the
device copy bandwidth measured in the same run.

  python3 bench/gpu_gemv_sweep.py --out bench/results/gpu_gemv_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.worker.kernels.gemv import gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def gemv_cfg(x, w, bn, bk, warps, stages):
    return gemv(x, w, None, config=(bn, bk, warps, stages))


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
        ref = torch.nn.functional.linear(x, ws[0])[0]
        nbytes = nn * kk * 2
        cub = timed(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
        row = {"cublas_ms": cub, "cublas_bw": nbytes / (cub / 1e3), "triton": []}
        for bn, bk, warps, stages in configs:
            try:
                y = gemv_cfg(x, ws[0], bn, bk, warps, stages)[0]
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                t = timed(lambda i: gemv_cfg(x, ws[i], bn, bk, warps, stages), copies)
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
