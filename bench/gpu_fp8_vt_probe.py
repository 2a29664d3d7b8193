"""An fp8 cache's V stored transposed per block (issue 19), timed on one GPU against the layout of
before in the same run (kernels/attention.py's module doc says why):

- before: V per block as [BS, kvh, d]; the p.V dot's B operand is then key-strided, which 16-bit
  caches load with ldmatrix.trans, while for 8-bit values Triton gathered V byte by byte from
  shared memory (SASS per warp and 64-key tile: 128 LDS.U8 and ~300 byte packs, 1,200 instructions);
- served: V per block as [kvh, d, BS] (attention.v_transposed), loaded as [d, blocks, BS] so each
  block's keys stay one 16-byte vector;
- with it, two constexprs that the SASS showed mattered for every cache: DECODE (a decode-only
  launch needs no causal mask) and HAS_WINDOW (a runtime `window > 0` test inside the key loop
  cost ~130 instructions per tile). `--before FILE`: the kernels module as it was before all
  three (a copy of kernels/attention.py), timed too.

Decode at batch 256, 64 and 1 (split-KV as served), ragged contexts, and prefill (1 and 4
prompts of 1,024 tokens) with a tile sweep for the transposed layout, its V read as a 3D
[d, blocks, BS] tile (served for decode) and as a 2D one with contiguity hints (kernels/attention.V_LOAD_2D: served for prefill).

A tried and dropped change, kept here as a record: the batch-1 GEMV with x loaded as a broadcast
tile in the weight's layout (no shared-memory redistribution and its barriers) was slower on an
H100 (gate_up 51.1 vs 44.8 us: more load instructions), as was the next weight tile prefetched
into registers (every shape, 5-40%).

  python3 bench/gpu_fp8_vt_probe.py [--before .gpuc3/attention_before.py] --out $OUT/gpu_fp8_vt_probe.json
  ncu ... python3 bench/gpu_fp8_vt_probe.py --ncu     (each kernel once, between cudaProfilerStart/Stop)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from services.worker import attention as ref  # noqa: E402
from services.worker.kernels import attention as ka  # noqa: E402
from services.worker.kernels.attention import decode_splits, paged_attention  # noqa: E402

NH, KVH, D, BS, CTX = 32, 8, 128, 16, 1536
PREFILL_CONFIGS = [(64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2), (64, 8, 3)]
# (BLOCK_M query rows = 16 tokens x 4 heads at 64, BLOCK_N keys, warps, stages) for the served prefill
PREFILL_TILES = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2)]
SHORT = False   # --short: the served configuration, the tiles and the kernels before only


def attn_inputs(b: int, ctx: int = CTX):
    g = torch.Generator(device="cuda").manual_seed(0)
    per = -(-ctx // BS)
    nb = b * per + 8
    base = torch.randn(2, nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = base.to(torch.float8_e4m3fn)                              # V as [BS, kvh, d] (before)
    vt = rows.clone()                                                # the served layout: V transposed
    ref.v_blocks(vt, True).copy_(rows[1])
    tables = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)[:b * per].view(b, per).contiguous()
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    # Ragged lengths too (not a multiple of the tile): the last block is partly filled.
    lens_r = torch.randint(ctx // 2, ctx + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
    return base, rows, vt, tables, lens, lens_r


def served(q, cache, tables, qsl, lens, transposed: bool, max_q: int = 1, load_2d: bool | None = None, **kw):
    """The served paged_attention with an fp8 cache's V read as stored before (transposed=False,
    the cache in [BS, kvh, d]) or transposed per block (the served layout); load_2d: the
    transposed V read as a 2D tile with contiguity hints (kernels/attention.V_LOAD_2D) or not."""
    ref.V_TRANSPOSE_FP8 = transposed
    default_2d = ka.V_LOAD_2D
    if load_2d is not None:
        ka.V_LOAD_2D = "always" if load_2d else "never"
    try:
        return paged_attention(q, cache, tables, qsl, lens, max_q, D ** -0.5, **kw)
    finally:
        ref.V_TRANSPOSE_FP8 = True
        ka.V_LOAD_2D = default_2d


def bench_into(rows: dict, floor_ms: float | None, label: str):
    def bench(name, fn, check=None):
        try:
            o = fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")
            row = {"ms": ms}
            if floor_ms:
                row["over_floor"] = ms / floor_ms
            if check is not None:
                row["max_abs_diff_vs_before"] = float((o.float() - check.float()).abs().max())
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile is a result
            row = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        rows[name] = row
        print(label, name, row, flush=True)
    return bench


def run_decode(res: dict, bw: float, before) -> None:
    for b in (256, 64, 1):
        base, rows_c, vt_c, tables, lens, lens_r = attn_inputs(b)
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(b, NH, D, device="cuda", dtype=torch.bfloat16, generator=g)
        qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
        floor_ms = 2 * b * CTX * KVH * D / bw * 1e3
        rows: dict = {"floor_ms": floor_ms}
        bench = bench_into(rows, floor_ms, b)
        sp = decode_splits(b, KVH)
        want = served(q, rows_c, tables, qsl, lens, False, num_splits=sp)
        want_r = served(q, rows_c, tables, qsl, lens_r, False, num_splits=sp)
        if before is not None and not SHORT:   # a kernels module from before the transposed V
            bench("head_fp8", lambda: before.paged_attention(q, rows_c, tables, qsl, lens, 1, D ** -0.5, num_splits=sp),
                  want)
            bench("head_bf16", lambda: before.paged_attention(q, base, tables, qsl, lens, 1, D ** -0.5, num_splits=sp))
        bench("rows_fp8", lambda: served(q, rows_c, tables, qsl, lens, False, num_splits=sp))
        bench("served_fp8", lambda: served(q, vt_c, tables, qsl, lens, True, num_splits=sp), want)
        if before is not None:
            bench("before_fp8_vt", lambda: before.paged_attention(q, vt_c, tables, qsl, lens, 1, D ** -0.5,
                                                                   num_splits=sp), want)
        bench("served_fp8_3d", lambda: served(q, vt_c, tables, qsl, lens, True, load_2d=False, num_splits=sp), want)
        bench("served_fp8_2d", lambda: served(q, vt_c, tables, qsl, lens, True, load_2d=True, num_splits=sp), want)
        bench("served_fp8_ragged", lambda: served(q, vt_c, tables, qsl, lens_r, True, num_splits=sp), want_r)
        bench("served_bf16", lambda: paged_attention(q, base, tables, qsl, lens, 1, D ** -0.5, num_splits=sp))
        if b > 1:
            for w, st in ((2, 3), (4, 3), (2, 4)):
                bench(f"served_fp8_w{w}_s{st}", lambda: served(q, vt_c, tables, qsl, lens, True, num_warps=w,
                                                              num_stages=st), want)
        res["decode"][str(b)] = rows
        del base, rows_c, vt_c
        torch.cuda.empty_cache()


def run_prefill(res: dict, before) -> None:
    for n in (1, 4):
        base, rows_c, vt_c, tables, lens, _ = attn_inputs(n, 1024)
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(n * 1024, NH, D, device="cuda", dtype=torch.bfloat16, generator=g)
        qsl = torch.arange(n + 1, device="cuda", dtype=torch.int32) * 1024
        rows: dict = {}
        bench = bench_into(rows, None, f"prefill {n}x1024")
        want = served(q, rows_c, tables, qsl, lens, False, 1024)
        if before is not None and not SHORT:
            bench("head_fp8", lambda: before.paged_attention(q, rows_c, tables, qsl, lens, 1024, D ** -0.5), want)
            bench("head_bf16", lambda: before.paged_attention(q, base, tables, qsl, lens, 1024, D ** -0.5))
        bench("rows_fp8", lambda: served(q, rows_c, tables, qsl, lens, False, 1024))
        bench("served_bf16", lambda: paged_attention(q, base, tables, qsl, lens, 1024, D ** -0.5))
        bench("served_fp8", lambda: served(q, vt_c, tables, qsl, lens, True, 1024), want)
        if before is not None:   # the kernels module before, over the served (transposed) layout
            bench("before_fp8_vt", lambda: before.paged_attention(q, vt_c, tables, qsl, lens, 1024, D ** -0.5), want)
        for bm, bn, w, st in PREFILL_TILES:
            bench(f"served_fp8_m{bm}_n{bn}_w{w}_s{st}",
                  lambda: served(q, vt_c, tables, qsl, lens, True, 1024, block_m=bm, block_n=bn, num_warps=w,
                                 num_stages=st), want)
        for bn, w, st in PREFILL_CONFIGS if not SHORT else ():
            for two in (False, True):
                bench(f"served_fp8_{'2d' if two else '3d'}_n{bn}_w{w}_s{st}",
                      lambda: served(q, vt_c, tables, qsl, lens, True, 1024, load_2d=two, block_n=bn, num_warps=w,
                                     num_stages=st), want)
        res["prefill"][f"{n}x1024"] = rows
        del base, rows_c, vt_c
        torch.cuda.empty_cache()


def profile_once(fns) -> None:
    """Each callable run once to compile and warm up, then once more inside the profiled range."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in fns:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def run_ncu() -> None:
    """Each kernel of interest once inside the profiled range (after compiling and warming up)."""
    base, rows_c, vt_c, tables, lens, _ = attn_inputs(256)
    q = torch.randn(256, NH, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(257, device="cuda", dtype=torch.int32)
    fns = [lambda: served(q, rows_c, tables, qsl, lens, False), lambda: served(q, vt_c, tables, qsl, lens, True),
           lambda: paged_attention(q, base, tables, qsl, lens, 1, D ** -0.5)]
    profile_once(fns)


def run_ncu_prefill() -> None:
    """4 prompts of 1,024 tokens over an fp8 cache, V as rows then transposed, once each."""
    base, rows_c, vt_c, tables, lens, _ = attn_inputs(4, 1024)
    q = torch.randn(4096, NH, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(5, device="cuda", dtype=torch.int32) * 1024
    fns = [lambda: served(q, rows_c, tables, qsl, lens, False, 1024),
           lambda: served(q, vt_c, tables, qsl, lens, True, 1024, load_2d=False),
           lambda: served(q, vt_c, tables, qsl, lens, True, 1024, load_2d=True)]
    profile_once(fns)


def load_before(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("attention_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_fp8_vt_probe.json")
    p.add_argument("--before", default=None, help="a copy of kernels/attention.py from before, timed too")
    p.add_argument("--ncu", action="store_true", help="run each kernel once in a profiled range, time nothing")
    p.add_argument("--ncu-prefill", action="store_true", help="the same for the prefill kernels (rows, transposed V)")
    p.add_argument("--short", action="store_true", help="skip the older layout and tile sweeps")
    a = p.parse_args()
    global SHORT
    SHORT = a.short
    if a.ncu:
        run_ncu()
        return 0
    if a.ncu_prefill:
        run_ncu_prefill()
        return 0
    before = load_before(a.before)
    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * (1 << 31) / (triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3)
    del x, y
    res: dict = {"bench": "gpu_fp8_vt_probe", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "copy_bytes_per_s": bw, "context": CTX, "decode": {}, "prefill": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_decode(res, bw, before)
    out.write_text(json.dumps(res, indent=1))
    run_prefill(res, before)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
