"""The elementwise kernels of a prefill step (issue 19), timed on one GPU at prefill row counts
against their byte floors, with the variants each could take. A profile of one prefill step of
8 prompts x 1,024 tokens (8B shape, FP8 weights and KV, H100, `bench/gpu_fp8.py --profile` ->
bench/results/gpu_fp8_v2d_h100.json) had the GEMMs at ~1.4 PFLOP/s but SiLU·mul at
15.2 ms of 134 and the q/k/v prep at 7.8 ms, 2.4x and ~4x their byte floors.

- silu_mul with FP8 output (the gate_up product's consumer): (BLOCK, warps[, ROWS]) of the
  program; BLOCK >= 14,336 holds a row whole (one read), else the rows are walked twice; ROWS rows
  a program share each chunk's column scales;
  Each under the served math and with parts of it undone (MATHS: SiLU's exp and division instead
  of the MUFU approximations, elementwise.FAST_SILU; activations quantised by division instead of
  by the row's reciprocal, fp8.RECIPROCAL_QUANT);
- the residual-add RMSNorm that scales the o / down product and quantises its output, under the
  served quantiser and the division;
- qkv_prep_ (RoPE and the K/V cache store): an fp8 cache with V transposed per block (served),
  with V as rows, a bf16 cache; heads per program; with the product's scales or without;
- the projections' FP8 GEMMs: unit-scaled (the consumer applies the token and channel scales,
  kernels/fp8.unscaled_mm) with full and with fast accumulation (kernels/fp8.FAST_ACCUM; the
  relative error of the fast one against the full one), against row-wise scaled in cuBLASLt's
  epilogue (nothing left for the consumer), with SiLU·mul's time with and without the scales.

  python3 bench/gpu_prefill_parts.py --out $OUT/gpu_prefill_parts.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402

from services.worker import attention as ref_attention  # noqa: E402
from services.worker.kernels import elementwise as ke  # noqa: E402
from services.worker.kernels import fp8 as fp8_kernels  # noqa: E402
from services.worker.kernels.fp8 import quantize_rows, unscaled_mm  # noqa: E402
from services.worker.kernels.qkv_prep import qkv_prep_  # noqa: E402
from services.worker.models.fp8 import quantize_weight  # noqa: E402

SILU_CONFIGS = [(2048, 16), (2048, 8), (16384, 32), (4096, 16), (2048, 16, 2)]
# (name, elementwise.FAST_SILU, fp8.RECIPROCAL_QUANT): the served math, and each part of it undone
MATHS = [("", True, True), ("exact", False, False), ("exact_silu", False, True), ("div_quant", True, False)]
WIDTH, NH, KVH, D, BS = 14336, 32, 8, 128, 16


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _math(fast: bool, rcp: bool) -> None:
    ke.FAST_SILU, fp8_kernels.RECIPROCAL_QUANT = fast, rcp


def silu_rows(t: int, bw: float, g) -> dict:
    """Each config with the served math; the served config and the whole row with each MATHS
    variant too (equal_to_served compares with the served config under the same math)."""
    x = torch.randn(t, 2 * WIDTH, device="cuda", generator=g).to(torch.bfloat16)
    rs = torch.rand(t, 1, device="cuda", generator=g) + 0.5
    cs = torch.rand(2 * WIDTH, device="cuda", generator=g) + 0.5
    floor_us = (t * 2 * WIDTH * 2 + t * WIDTH) / bw * 1e6
    rows: dict = {"floor_us": floor_us}
    try:
        for math, fast, rcp in MATHS:
            _math(fast, rcp)
            ref_q, ref_s = ke.silu_mul(x, in_scales=(rs, cs), fp8_out=True, fp8_config=SILU_CONFIGS[0])
            for cfg in (SILU_CONFIGS + [None]) if not math else [SILU_CONFIGS[0], (16384, 32)]:
                key = "served" if cfg is None else "x".join(map(str, cfg))
                key += f"_{math}" if math else ""
                try:
                    q, s = ke.silu_mul(x, in_scales=(rs, cs), fp8_out=True, fp8_config=cfg)
                    same = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s))
                    us = timed(lambda cfg=cfg: ke.silu_mul(x, in_scales=(rs, cs), fp8_out=True, fp8_config=cfg))
                    rows[key] = {"us": us, "over_floor": us / floor_us, "equal_to_served": same}
                except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run is a result
                    rows[key] = {"error": repr(exc)[:200]}
                print("silu", t, key, rows[key], flush=True)
    finally:
        _math(True, True)
    return rows


def norm_rows(t: int, bw: float, g) -> dict:
    """The residual-add RMSNorm that scales the o / down product and quantises for the next
    projection (4,096 wide), under each MATHS variant's quantiser."""
    h = 4096
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16) * 50
    res0 = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(h, device="cuda", generator=g).to(torch.bfloat16) + 0.5
    rs = torch.rand(t, 1, device="cuda", generator=g) + 0.5
    cs = torch.rand(h, device="cuda", generator=g) * 0.01
    res = res0.clone()
    # x and the residual read, the residual written, the e4m3 output written
    rows: dict = {"floor_us": t * h * 7 / bw * 1e6}
    try:
        for math, fast, rcp in MATHS[:2]:
            _math(fast, rcp)
            us = timed(lambda: ke.add_rms_norm(x, w, 1e-5, residual=res, in_scales=(rs, cs), fp8_out=True))
            rows[math or "served"] = {"us": us, "over_floor": us / rows["floor_us"]}
            print("norm", t, math or "served", rows[math or "served"], flush=True)
    finally:
        _math(True, True)
    return rows


def qkv_rows(t: int, bw: float, g) -> dict:
    cols = (NH + 2 * KVH) * D
    qkv0 = torch.randn(t, cols, device="cuda", generator=g).to(torch.bfloat16)
    rs = torch.rand(t, 1, device="cuda", generator=g) + 0.5
    cs = torch.rand(cols, device="cuda", generator=g) + 0.5
    nb = t // BS + 16
    # Prompts of 1,024 tokens on shuffled blocks, each block filled in order (as a prefill is).
    blocks = torch.randperm(nb, device="cuda", generator=g)[:t // BS]
    slots = (blocks[:, None] * BS + torch.arange(BS, device="cuda")).reshape(-1).to(torch.int64)
    positions = (torch.arange(t, device="cuda") % 1024).to(torch.int64)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    ang = torch.arange(4096, device="cuda").float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], 1).contiguous()
    sin = torch.cat([ang.sin(), ang.sin()], 1).contiguous()
    # Bytes: qkv read, q and k written back (bf16), K and V into the cache.
    rows: dict = {"floor_us_fp8": (t * cols * 2 + t * (NH + KVH) * D * 2 + t * 2 * KVH * D) / bw * 1e6}
    # (name, cache dtype, V transposed, heads a program, product scales, KV scale: 1 skips the division)
    variants = [("fp8_vt", torch.float8_e4m3fn, True, None, True, 1.0), ("fp8_rows", torch.float8_e4m3fn, False, None, True, 1.0),
                ("bf16", torch.bfloat16, True, None, True, 1.0), ("fp8_vt_unscaled", torch.float8_e4m3fn, True, None, False, 1.0),
                ("fp8_vt_kv_scale_0.5", torch.float8_e4m3fn, True, None, True, 0.5),
                ("fp8_vt_h8", torch.float8_e4m3fn, True, 8, True, 1.0), ("fp8_vt_h32", torch.float8_e4m3fn, True, 32, True, 1.0)]
    for name, dt, vt, hpp, scaled, kv_scale in variants:
        ref_attention.V_TRANSPOSE_FP8 = vt
        try:
            cache = torch.zeros(2, nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16).to(dt)
            qkv = qkv0.clone()

            def fn():
                qkv_prep_(qkv, positions, cos, sin, cache, slots, NH, KVH, D, heads_per_program=hpp,
                          in_scales=(rs, cs) if scaled else None, k_scale=kv_scale, v_scale=kv_scale)
            fn()
            rows[name] = {"us": timed(fn)}
            rows[name]["over_floor_fp8"] = rows[name]["us"] / rows["floor_us_fp8"]
        except Exception as exc:  # noqa: BLE001
            rows[name] = {"error": repr(exc)[:200]}
        finally:
            ref_attention.V_TRANSPOSE_FP8 = True
        print("qkv_prep", t, name, rows[name], flush=True)
    return rows


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def gemm_rows(t: int, g) -> dict:
    rows: dict = {}
    for name, (n, k) in SHAPES.items():
        w = quantize_weight(torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.02)
        x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
        q, s = quantize_rows(x)
        fast = fp8_kernels.FAST_ACCUM
        try:
            fp8_kernels.FAST_ACCUM = False
            unit = timed(lambda: unscaled_mm((q, s), w, torch.bfloat16))
            exact = unscaled_mm((q, s), w, torch.float32)
            fp8_kernels.FAST_ACCUM = True
            unit_fast = timed(lambda: unscaled_mm((q, s), w, torch.bfloat16))
            fast_err = float((unscaled_mm((q, s), w, torch.float32) - exact).norm() / exact.norm())
        finally:
            fp8_kernels.FAST_ACCUM = fast
        roww = timed(lambda: torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w.scale[None, :],
                                              out_dtype=torch.bfloat16))
        flops = 2 * t * n * k
        rows[name] = {"unit_us": unit, "unit_fast_accum_us": unit_fast, "rowwise_us": roww,
                      "unit_tflops": flops / unit / 1e6, "unit_fast_accum_tflops": flops / unit_fast / 1e6,
                      "rowwise_tflops": flops / roww / 1e6, "fast_accum_relative_error": fast_err}
        print("gemm", t, name, rows[name], flush=True)
    x = torch.randn(t, 2 * WIDTH, device="cuda", generator=g).to(torch.bfloat16)
    rs = torch.rand(t, 1, device="cuda", generator=g) + 0.5
    cs = torch.rand(2 * WIDTH, device="cuda", generator=g) + 0.5
    rows["silu_scaled_us"] = timed(lambda: ke.silu_mul(x, in_scales=(rs, cs), fp8_out=True))
    rows["silu_unscaled_us"] = timed(lambda: ke.silu_mul(x, fp8_out=True))
    print("gemm", t, "silu scaled / unscaled", rows["silu_scaled_us"], rows["silu_unscaled_us"], flush=True)
    return rows


def main() -> int:
    from gpu_fp8_kernels import copy_bw
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_prefill_parts.json")
    p.add_argument("--rows", default="256,1024,8192")
    p.add_argument("--parts", default="silu,norm,qkv,gemm")
    a = p.parse_args()
    bw = copy_bw()
    res: dict = {"bench": "gpu_prefill_parts", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "copy_bytes_per_s": bw,
                 "silu_mul": {}, "norm": {}, "qkv_prep": {}, "gemm": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for t in (int(x) for x in a.rows.split(",")):
        if "silu" in a.parts:
            res["silu_mul"][str(t)] = silu_rows(t, bw, g)
        if "norm" in a.parts:
            res["norm"][str(t)] = norm_rows(t, bw, g)
        if "qkv" in a.parts:
            res["qkv_prep"][str(t)] = qkv_rows(t, bw, g)
        if "gemm" in a.parts:
            res["gemm"][str(t)] = gemm_rows(t, g)
        out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
