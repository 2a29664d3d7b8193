"""Where a prefill step's wall time outside kernels goes (issue 19): one step of 8 prompts x 1,024
tokens, 8B shape, FP8 weights and KV, timed standalone (wall, and when run() returns), under
cProfile (host functions), and under torch.profiler with CPU and CUDA activities: the first
kernel's delay after the step's first host event, the GPU's busy and idle time inside the step,
the largest idle gaps between kernels.

  python3 bench/gpu_prefill_host.py    (prints only; ~30 s on an H100)

H100 -> bench/results/gpu_prefill_host_h100.txt.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpu_decode import (Reqs, build_model, finish, kv_runner, llama31_8b_config, prefill_walls,  # noqa: E402
                        prompt_plan, run)
from services.worker.models.fp8 import quantize_layers  # noqa: E402


def main() -> int:
    model = build_model(llama31_8b_config(), 4096)
    quantize_layers(model.layers)
    runner = kv_runner(model, 30, torch.float8_e4m3fn)
    reqs = Reqs(runner.num_blocks)
    gen = torch.Generator().manual_seed(0)

    for i in range(3):   # warm-up: every kernel compiled, the allocator settled
        p, ids = prompt_plan(reqs, gen, f"hw{i}", 8, 1024)
        run(runner, p)
        finish(runner, reqs, ids)
    print("walls ms", [round(w, 1) for w in prefill_walls(runner, reqs, gen, 8, 1024)])
    p, ids = prompt_plan(reqs, gen, "hs", 8, 1024)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(runner, p)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    finish(runner, reqs, ids)
    print("run() returned after ms", round((t1 - t0) * 1e3, 1), "then GPU done after", round((t2 - t0) * 1e3, 1))
    p, ids = prompt_plan(reqs, gen, "hc", 8, 1024)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    run(runner, p)
    torch.cuda.synchronize()
    pr.disable()
    finish(runner, reqs, ids)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    p, ids = prompt_plan(reqs, gen, "hk", 8, 1024)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(runner, p)
        torch.cuda.synchronize()
    finish(runner, reqs, ids)
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ev]
    ends = [e.time_range.end for e in ev]
    gaps = [starts[i + 1] - max(ends[:i + 1]) for i in range(len(ev) - 1)]
    big = sorted([(g, ev[i].name[:40], ev[i + 1].name[:40]) for i, g in enumerate(gaps)], reverse=True)[:12]
    print("kernels", len(ev), "span us", ends[-1] - starts[0],
          "busy us", sum(e.time_range.end - e.time_range.start for e in ev), "idle us", sum(g for g in gaps if g > 0))
    print("largest gaps (us, after, before):", big)
    first = min(e.time_range.start for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
    print("first kernel starts us after first CPU event", starts[0] - first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
