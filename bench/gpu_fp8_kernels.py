"""FP8 projection kernels on one H200, timed inside CUDA graphs (no launch gaps) with the weights
rotated over enough copies that L2 never holds them, at the Llama-3.1-8B projection shapes:

- M = 1: the FP8 GEMV (kernels/fp8.gemv_fp8) over a sweep of tile configs, against the bf16 GEMV
  and the weight bytes at the copy bandwidth measured in the same run;
- M = 2 .. 4096: bf16 cuBLAS; torch._scaled_mm with row-wise scales (what runs today) and with
  tensor-wise ones; the Triton FP8-weight GEMM (bench/triton_fp8_gemm.py) W8A8 and W8A16 over a few
  configs each; the per-token quantiser two-pass and one-pass;
- `--profile`: the 8B model with FP8 weights and an fp8 KV cache, kernels of one decode graph
  replay at batch 1 / 64 / 256 (what the step's time is made of).

  python3 bench/gpu_fp8_kernels.py [--profile] [--out bench/results/gpu_fp8_kernels.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.worker.kernels.fp8 import gemv_fp8, quantize_rows  # noqa: E402
from triton_fp8_gemm import fp8w_gemm  # noqa: E402
from services.worker.kernels.gemv import gemv  # noqa: E402
from services.worker.models.fp8 import quantize_weight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
GEMV_CONFIGS = [(bn, bk, w, s) for bn in (8, 16, 32) for bk in (512, 1024, 2048) for w in (4, 8) for s in (2, 4)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap) and the M range each is tried at
GEMM_CONFIGS = [
    ((16, 64, 256, 4, 4, True), (2, 32)), ((16, 128, 256, 4, 3, True), (2, 32)),
    ((16, 32, 512, 4, 4, True), (2, 32)), ((32, 64, 256, 4, 4, True), (16, 64)),
    ((64, 64, 256, 4, 4, True), (32, 128)), ((64, 128, 128, 4, 4, True), (32, 256)),
    ((64, 64, 128, 4, 4, False), (32, 256)), ((64, 128, 128, 4, 4, False), (64, 1024)),
    ((128, 64, 128, 4, 4, False), (128, 1024)), ((128, 128, 128, 8, 3, False), (128, 4096)),
    ((128, 256, 128, 8, 3, False), (256, 4096)),
]


def graph_us(fns, reps: int = 10) -> float:
    """Mean µs per call of the callables (one per weight copy), captured back to back in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * 2 * len(fns))


def copy_bw() -> float:
    n = 2 ** 30
    x, y = torch.empty(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    graph_us([lambda: y.copy_(x)], 20)   # clocks up first
    us = graph_us([lambda: y.copy_(x)], 20)
    return 2 * n * 2 / (us / 1e6)


def safe(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a config Triton cannot compile is a result, not a crash
        return repr(exc)[:160]


def sweep_shape(name: str, n: int, k: int, bw: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(3)
    copies = max(2, math.ceil(4e8 / (n * k)))   # >= 400 MB of FP8 weights: never served from L2
    bfs = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    fws = [quantize_weight(w) for w in bfs]
    out: dict = {"N": n, "K": k, "fp8_floor_us_M1": n * k / bw * 1e6, "bf16_floor_us_M1": 2 * n * k / bw * 1e6}
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out["gemv_bf16_us"] = safe(lambda: graph_us([lambda w=w: gemv(x1, w) for w in bfs]))
    out["cublas_bf16_M1_us"] = safe(lambda: graph_us([lambda w=w: F.linear(x1, w) for w in bfs]))
    gemv_rows = []
    for cfg in GEMV_CONFIGS:
        us = safe(lambda cfg=cfg: graph_us([lambda w=w: gemv_fp8(x1, w, config=cfg) for w in fws]))
        gemv_rows.append({"config": cfg, "us": us})
    out["gemv_fp8"] = gemv_rows
    ok = [r for r in gemv_rows if isinstance(r["us"], float)]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        out["gemv_fp8_best"] = {**best, "TBps": n * k / (best["us"] / 1e6) / 1e12}
    rows = []
    for m in MS:
        a = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        qa, sa = quantize_rows(a)
        one = torch.ones(1, device="cuda")
        r: dict = {"M": m, "fp8_floor_us": (n * k + m * k + 2 * m * n) / bw * 1e6,
                   "fp8_compute_floor_us": 2 * m * n * k / 1.29e15 * 1e6}
        r["bf16_cublas"] = safe(lambda: graph_us([lambda w=w: F.linear(a, w) for w in bfs]))
        r["scaled_mm_rowwise"] = safe(lambda: graph_us([lambda w=w: torch._scaled_mm(
            qa, w.weight.t(), scale_a=sa, scale_b=w.scale[None, :], out_dtype=torch.bfloat16) for w in fws]))
        r["scaled_mm_tensorwise"] = safe(lambda: graph_us([lambda w=w: torch._scaled_mm(
            qa, w.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16) for w in fws]))
        r["quant_two_pass"] = safe(lambda: graph_us([lambda: quantize_rows(a, one_pass=False)]))
        r["quant_one_pass"] = safe(lambda: graph_us([lambda: quantize_rows(a)]))
        tri = []
        for cfg, (lo, hi) in GEMM_CONFIGS:
            if not lo <= m <= hi:
                continue
            w8a8 = safe(lambda cfg=cfg: graph_us([lambda w=w: fp8w_gemm(qa, w.weight, w.scale, sa, None, torch.bfloat16, cfg)
                                                  for w in fws]))
            w8a16 = safe(lambda cfg=cfg: graph_us([lambda w=w: fp8w_gemm(a, w.weight, w.scale, None, None, torch.bfloat16, cfg)
                                                   for w in fws]))
            tri.append({"config": cfg, "w8a8": w8a8, "w8a16": w8a16})
        r["triton"] = tri
        for mode in ("w8a8", "w8a16"):
            ok = [t for t in tri if isinstance(t[mode], float)]
            if ok:
                b = min(ok, key=lambda t: t[mode])
                r[f"triton_{mode}_best"] = {"config": b["config"], "us": b[mode]}
        rows.append(r)
        print(name, m, {kk: v for kk, v in r.items() if kk != "triton"}, flush=True)
    out["rows"] = rows
    del fws, bfs
    torch.cuda.empty_cache()
    return out


def _smi_sampler(stop, out: list) -> None:
    import subprocess
    while not stop.is_set():
        try:
            out.append(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active",
                                       "--format=csv,noheader"], capture_output=True, text=True, timeout=5).stdout.strip())
        except Exception as exc:  # noqa: BLE001
            out.append(repr(exc))
        stop.wait(0.25)


def step_probe(runner, batch: int, steps: int, pipelined: bool) -> dict:
    """`steps` decode steps of `batch` rows (context ~1,536), one at a time or two in flight, under
    torch.profiler (CUDA kernels) with nvidia-smi sampled meanwhile: wall per step against the
    kernels' summed time and the GPU's busy time (union of kernel intervals) per step."""
    import threading
    from torch.profiler import ProfilerActivity, profile as tprofile
    from gpu_decode import GREEDY, Reqs, checked, run
    from services.common import pb
    from services.worker.wire import ProtoRunner
    reqs = Reqs(runner.num_blocks)
    gen = torch.Generator().manual_seed(5)
    start = 1536 - steps
    plan = reqs.plan()
    ids = [f"p{batch}-{i}" for i in range(batch)]
    for rid in ids:
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (start,), generator=gen).tolist(),
                              block_ids=reqs.blocks(start + steps + 2), num_computed_tokens=start - 1,
                              num_scheduled_tokens=1, sampling=GREEDY)
    run(runner, plan)
    wired = ProtoRunner(runner)

    def one(s):
        p = reqs.plan()
        for rid in ids:
            p.cached_requests.add(request_id=rid, num_computed_tokens=start + s, num_scheduled_tokens=1)
        return p
    for s in range(3):   # warm
        checked(wired.execute(one(s)))
    samples: list = []
    stop = threading.Event()
    th = threading.Thread(target=_smi_sampler, args=(stop, samples), daemon=True)
    th.start()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        pending = None
        for s in range(3, steps):
            if pipelined:
                nxt = wired.submit(one(s))
                if pending is not None:
                    checked(wired.collect(pending))
                pending = nxt
            else:
                checked(wired.execute(one(s)))
        if pending is not None:
            checked(wired.collect(pending))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    stop.set()
    th.join()
    done = reqs.plan()
    done.finished_ids.extend(ids)
    run(runner, done)
    n = steps - 3
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev)
    busy, cur_s, cur_e = 0.0, None, None
    for a, b in spans:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        busy += cur_e - cur_s
    top = {}
    for e in ev:
        top[e.name[:60]] = top.get(e.name[:60], 0.0) + (e.time_range.end - e.time_range.start)
    return {"batch": batch, "pipelined": pipelined, "steps": n, "wall_ms_per_step": wall * 1e3 / n,
            "kernel_sum_ms_per_step": sum(e.time_range.end - e.time_range.start for e in ev) / 1e3 / n,
            "gpu_busy_ms_per_step": busy / 1e3 / n,
            "top_kernels_ms_per_step": sorted(((k, v / 1e3 / n) for k, v in top.items()), key=lambda kv: -kv[1])[:8],
            "smi": samples[:40]}


def profile(res: dict, save) -> None:
    from gpu_decode import Reqs, build_model, decode_steps, kv_runner, llama31_8b_config, profile_replay
    from services.worker.models.fp8 import quantize_layers
    cfg = llama31_8b_config()
    gen = torch.Generator().manual_seed(0)
    model = build_model(cfg, 4096)
    quantize_layers(model.layers)
    runner = kv_runner(model, 48.0, torch.float8_e4m3fn)
    res["probes"] = []
    for b, pipe in ((256, False), (256, True), (64, False), (64, True)):
        r = step_probe(runner, b, 40, pipe)
        res["probes"].append(r)
        print("probe", {k: v for k, v in r.items() if k != "smi"}, r["smi"][:3], flush=True)
        save()
    res["profile"] = {}
    for b in (1, 64, 256):
        r = decode_steps(runner, Reqs(runner.num_blocks), b, 1536, 10, gen)
        r["replay_kernels"] = profile_replay(runner, b)
        res["profile"][str(b)] = r
        print("profile", b, r, flush=True)
        save()


KV_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


def attn_sweep(res: dict, save, batches=(64, 256), n_dtypes: int = 2, wide: bool = True) -> None:
    """Decode attention of one Llama-3-8B layer (32 q heads, 8 KV heads, d 128) over random
    1,536-token contexts in random blocks of 16, per KV dtype and batch, over tile configs."""
    from services.worker.kernels.attention import decode_splits, paged_attention
    g = torch.Generator(device="cuda").manual_seed(9)
    rows = []
    for kv_dtype in KV_DTYPES[:n_dtypes]:
        for b in batches:
            ctx, bs = 1536, 16
            nb = b * ctx // bs
            cache = torch.randn(2, nb, bs, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16).to(kv_dtype)
            tables = torch.randperm(nb, device="cuda", generator=g).to(torch.int32).view(b, ctx // bs)
            qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
            lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            q = torch.randn(b, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            splits = decode_splits(b, 8)
            base = safe(lambda: graph_us([lambda: paged_attention(q, cache, tables, qsl, lens, 1, 0.088, out=out,
                                                                  num_splits=splits)], 20))
            nbytes = cache.numel() * cache.element_size()
            r = {"kv": str(kv_dtype), "batch": b, "default_us": base, "kv_bytes": nbytes,
                 "default_TBps": nbytes / (base / 1e6) / 1e12 if isinstance(base, float) else None, "configs": []}
            for bn in (32, 64, 128):
                for warps in ((1, 2, 4, 8) if wide else (2, 4)):
                    for stages in ((2, 3, 4, 6, 8) if wide else (3, 6)):
                        us = safe(lambda: graph_us([lambda: paged_attention(
                            q, cache, tables, qsl, lens, 1, 0.088, out=out, num_splits=splits, block_n=bn,
                            num_warps=warps, num_stages=stages)], 10))
                        r["configs"].append({"block_n": bn, "warps": warps, "stages": stages, "us": us})
            ok = [c for c in r["configs"] if isinstance(c["us"], float)]
            r["best"] = min(ok, key=lambda c: c["us"]) if ok else None
            rows.append(r)
            print("attn", {k: v for k, v in r.items() if k != "configs"}, flush=True)
            res["attn_sweep"] = rows
            save()
            del cache
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_fp8_kernels.json")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--attn", action="store_true", help="the decode attention tile sweep")
    p.add_argument("--attn-quick", action="store_true", help="fp8 cache, batches 64 and 256, 12 configs")
    a = p.parse_args()
    res: dict = {"bench": "gpu_fp8_kernels", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = Path(a.out)

    def save():
        out.write_text(json.dumps(res, indent=1))
    res["copy_bytes_per_s"] = bw = copy_bw()
    print("copy TB/s", bw / 1e12, flush=True)
    if a.attn:
        attn_sweep(res, save)
    if a.attn_quick:
        attn_sweep(res, save, batches=(64, 256), n_dtypes=1, wide=False)
    if a.profile:
        profile(res, save)
    res["shapes"] = {}
    for name in ([] if a.no_sweep else a.shapes.split(",")):
        n, k = SHAPES[name]
        res["shapes"][name] = sweep_shape(name, n, k, bw)
        save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
