"""Sweep the paged-attention kernel's tile shapes on the GPU (Triton cannot autotune under the CPU
interpreter, so defaults are chosen from this run), and profile the runner's host time per decode
step at batch 256. Writes JSON to --out.

  python3 bench/gpu_attn_sweep.py --out bench/results/gpu_attn_sweep.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from services.worker.kernels.attention import decode_splits, paged_attention  # noqa: E402

NH, KVH, D, BS = 32, 8, 128, 16


def inputs(specs, nb):
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    mb = max(-(-(c + s) // BS) for c, s in specs)
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    tables = perm[:len(specs) * mb].view(len(specs), mb).contiguous()
    qsl = torch.tensor([0] + [s for _, s in specs], device="cuda").cumsum(0).to(torch.int32)
    lens = torch.tensor([c + s for c, s in specs], device="cuda", dtype=torch.int32)
    t = sum(s for _, s in specs)
    q = torch.randn(t, NH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, tables, qsl, lens


def sweep(name, specs, nb, configs, out):
    q, cache, tables, qsl, lens = inputs(specs, nb)
    mq = max(s for _, s in specs)
    rows = []
    for cfg in configs:
        try:
            ms = triton.testing.do_bench(lambda: paged_attention(q, cache, tables, qsl, lens, mq, D ** -0.5, **cfg),
                                         warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
            ms = None
            cfg = {**cfg, "error": type(exc).__name__}
        rows.append({**cfg, "ms": ms})
    rows.sort(key=lambda r: r["ms"] if r["ms"] is not None else 1e9)
    out[name] = rows
    print(name, rows[:3], flush=True)


def host_profile(out):
    from bench.gpu_decode import GREEDY, Reqs, build_model, llama31_8b_config, run
    from services.common import pb
    from services.worker.runner import ModelRunner
    model = build_model(llama31_8b_config(), 4096)
    runner = ModelRunner(model, model_name="x", kv_cache_bytes=56 << 30, block_size=BS)
    runner.hello(BS)
    reqs = Reqs(runner.num_blocks)
    plan = reqs.plan()
    for i in range(256):
        plan.new_requests.add(request_id=f"r{i}", token_ids=[5] * 1536, block_ids=reqs.blocks(1600),
                              num_computed_tokens=1535, num_scheduled_tokens=1, sampling=GREEDY)
    run(runner, plan)

    def step(s):
        p = reqs.plan()
        for i in range(256):
            p.cached_requests.add(request_id=f"r{i}", num_computed_tokens=1536 + s, num_scheduled_tokens=1)
        run(runner, p)
    for s in range(5):
        step(s)
    pr = cProfile.Profile()
    pr.enable()
    for s in range(5, 25):
        step(s)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
    out["host_profile_b256_20_steps"] = buf.getvalue()[-6000:]
    print(buf.getvalue()[-4000:], flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_attn_sweep.json")
    a = p.parse_args()
    out = {}
    pre = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
           for m, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
    sweep("prefill_1x1024", [(0, 1024)], 2000, pre, out)
    sweep("prefill_chunk_512_after_1024", [(1024, 512)] * 4, 2000, pre, out)
    for b in (1, 64, 256):
        s0 = decode_splits(b, KVH)
        dec = [dict(block_m=16, block_n=n, num_warps=w, num_stages=st, num_splits=sp)
               for n, w, st, sp in itertools.product((32, 64, 128), (2, 4), (2, 3), sorted({s0, max(1, s0 // 2), s0 * 2}))
               if sp <= 32]
        sweep(f"decode_b{b}_ctx1536", [(1535, 1)] * b, 30000, dec, out)
    Path(a.out).write_text(json.dumps(out, indent=1))
    host_profile(out)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
