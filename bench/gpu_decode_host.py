"""What a pipelined decode step at 512 rows costs beyond its graph replay (issue 19: in the offline
run a decode step's median is ~0.8 ms over the replay at the same context). 8B shape, FP8 weights
and KV, `--batch` requests at ~1,536 tokens, steps submitted and collected as the engine loop
does (step N+1 submitted before step N is collected):

- the graph replay alone, and the pipelined loop's interval between results;
- the host's time per step in submit() and collect();
- under torch.profiler (CPU and CUDA): the GPU's busy and idle time over a few pipelined steps
  and the largest idle gaps with the kernels on either side;
- under cProfile: the host functions by own time, per step.

  python3 bench/gpu_decode_host.py [--batch 512] [--kv-gib 100]     (prints only)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpu_decode import GREEDY, Reqs, build_model, checked, cuda_time_ms, kv_runner, llama31_8b_config, run  # noqa: E402
from services.common.gc_heap import freeze_startup_heap  # noqa: E402
from services.worker.models.fp8 import quantize_layers  # noqa: E402
from services.worker.wire import ProtoRunner  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--ctx", type=int, default=1536)
    p.add_argument("--kv-gib", type=float, default=100.0)
    a = p.parse_args()
    model = build_model(llama31_8b_config(), 4096)
    quantize_layers(model.layers)
    runner = kv_runner(model, a.kv_gib, torch.float8_e4m3fn)
    reqs = Reqs(runner.num_blocks)
    gen = torch.Generator().manual_seed(0)
    steps = 60
    start = a.ctx - steps // 2
    plan = reqs.plan()
    ids = [f"h{i}" for i in range(a.batch)]
    for rid in ids:
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (start,), generator=gen).tolist(),
                              block_ids=reqs.blocks(start + steps + 2), num_computed_tokens=start - 1,
                              num_scheduled_tokens=1, sampling=GREEDY)
    run(runner, plan)
    freeze_startup_heap()
    wired = ProtoRunner(runner)
    pos = [start]

    def next_plan():
        pl = reqs.plan()
        for rid in ids:
            pl.cached_requests.add(request_id=rid, num_computed_tokens=pos[0], num_scheduled_tokens=1)
        pos[0] += 1
        return pl

    def pipelined(n: int, host: list | None = None) -> list[float]:
        """n steps, two in flight; the interval between results (ms)."""
        pending, last, gaps = None, None, []
        for _ in range(n):
            t0 = time.perf_counter()
            pl = next_plan()
            nxt = wired.submit(pl)
            t1 = time.perf_counter()
            if pending is not None:
                checked(wired.collect(pending))
                now = time.perf_counter()
                if host is not None:
                    host.append((t1 - t0, now - t1))
                if last is not None:
                    gaps.append((now - last) * 1e3)
                last = now
            pending = nxt
        checked(wired.collect(pending))
        return gaps

    pipelined(5)
    graph = runner.gpu.graphs.get(a.batch)
    replay = cuda_time_ms(graph[0].replay, 10) if graph else None
    host: list = []
    gaps = pipelined(20, host)
    print(f"batch {a.batch} ctx ~{pos[0]}: replay {replay:.3f} ms; pipelined interval median "
          f"{statistics.median(gaps):.3f} ms (min {min(gaps):.3f}, max {max(gaps):.3f})")
    print(f"host per step: plan + submit {statistics.median(h[0] for h in host) * 1e3:.3f} ms, "
          f"collect (incl. waiting) {statistics.median(h[1] for h in host) * 1e3:.3f} ms")

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        pipelined(6)
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ev]
    ends = [e.time_range.end for e in ev]
    run_end = ends[0]
    gaps_us = []
    for i in range(len(ev) - 1):
        run_end = max(run_end, ends[i])
        gaps_us.append((starts[i + 1] - run_end, ev[i].name[:50], ev[i + 1].name[:50]))
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    print("kernels", len(ev), "span us", ends[-1] - starts[0], "busy us (sum, overlaps counted twice)", busy,
          "idle us", sum(g for g, _, _ in gaps_us if g > 0))
    print("largest gaps (us, after, before):")
    for g in sorted(gaps_us, reverse=True)[:14]:
        print("  ", round(g[0], 1), "|", g[1], "|", g[2])
    names: dict = {}
    for e in ev:
        names.setdefault(e.name[:60], [0, 0.0])
        names[e.name[:60]][0] += 1
        names[e.name[:60]][1] += e.time_range.end - e.time_range.start
    print("kernels outside the model's own (count, us):")
    for n, (c, t) in sorted(names.items(), key=lambda x: -x[1][1])[:25]:
        print("  ", c, round(t, 1), n)

    pr = cProfile.Profile()
    pr.enable()
    pipelined(10)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print("cProfile over 10 pipelined steps:\n" + s.getvalue()[:5000])
    fin = reqs.plan()
    fin.finished_ids.extend(ids)
    run(runner, fin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
