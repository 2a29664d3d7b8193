"""Scheduler CPU cost per step with 256 running requests and a no-compute worker.

  .venv/bin/python bench/scheduler_overhead.py [--running 256] [--steps 2000]

Measures, per decode step: the pure core (schedule + update), and the core plus the protobuf
work the adapter adds (StepPlan encode, StepResult decode, OutputBatch encode). The target is
<= 1 ms median, well inside a GPU decode step of an 8B model (3.8-16 ms). Writes
bench/results/scheduler_overhead.json."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common import pb  # noqa: E402
from services.scheduler import wire  # noqa: E402
from services.scheduler.core import Request, SampledTokens, Scheduler, SchedulerConfig, StepResult  # noqa: E402

GPU_STEP_FLOOR_MS = 3.8


def fake_result(plan) -> StepResult:
    """What a no-compute worker returns: one token for every request that reached its end."""
    sampled = [SampledTokens(r.request_id, [7]) for r in plan.new_requests if
               r.num_computed_tokens + r.num_scheduled_tokens == len(r.token_ids)]
    sampled += [SampledTokens(r.request_id, [7]) for r in plan.cached_requests]
    return StepResult(plan.step_id, sampled)


def measure(running: int, steps: int, async_depth: int, with_proto: bool, prefix_caching: bool) -> list[float]:
    cfg = SchedulerConfig(max_model_len=4096, max_num_seqs=running, max_num_batched_tokens=8192, block_size=16,
                          enable_prefix_caching=prefix_caching)
    s = Scheduler(cfg, num_blocks=running * 80, eos_token_ids=frozenset({0}), vocab_size=50_000)
    sp = pb.common.SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(running):
        s.add_request(Request(f"req-{i:05d}", [(i * 7 + k) % 49_000 + 1 for k in range(128)], 10_000,
                              sampling=sp, ignore_eos=True))
    inflight = []
    times = []
    for step in range(steps + 20):
        t0 = time.perf_counter()
        plan = s.schedule()
        if with_proto:
            wire.plan_to_proto(plan).SerializeToString()
        inflight.append(plan)
        worker_s = 0.0
        if len(inflight) >= async_depth:
            done = inflight.pop(0)
            # The no-compute worker's own work (building its reply) is not scheduler time.
            w0 = time.perf_counter()
            res = fake_result(done)
            if with_proto:
                msg = pb.step.StepResult(step_id=res.step_id)
                for o in res.sampled:
                    msg.outputs.add(request_id=o.request_id, token_ids=o.token_ids)
                frame = msg.SerializeToString()
            worker_s = time.perf_counter() - w0
            if with_proto:
                res = wire.result_from_proto(pb.step.StepResult.FromString(frame))
            outs = s.update(done, res)
            if with_proto:
                wire.outputs_to_proto(done.step_id, outs).SerializeToString()
        dt = time.perf_counter() - t0 - worker_s
        if step >= 20:  # skip the prefill steps
            times.append(dt * 1e3)
    return times


def summary(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=100)
    return {"median_ms": statistics.median(times), "p90_ms": q[89], "p99_ms": q[98], "mean_ms": statistics.fmean(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    rows = {}
    for name, depth, proto, pc in [("core, sync", 1, False, True), ("core, async", 2, False, True),
                                   ("core + protobuf, async", 2, True, True),
                                   ("core + protobuf, async, no prefix caching", 2, True, False)]:
        rows[name] = summary(measure(a.running, a.steps, depth, proto, pc))
    res = {"schema": 1, "bench": "scheduler_overhead", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "running": a.running, "steps": a.steps, "target_ms": 1.0, "gpu_step_floor_ms": GPU_STEP_FLOOR_MS,
           "rows": rows,
           "ratios": {k: {"median_vs_target": v["median_ms"] / 1.0,
                          "median_vs_gpu_step_floor": v["median_ms"] / GPU_STEP_FLOOR_MS} for k, v in rows.items()}}
    out = ROOT / "bench" / "results" / "scheduler_overhead.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"{a.running} running requests, decode steps, per step:")
    print(f"{'':44}{'median':>9}{'p90':>9}{'p99':>9}  median/target  median/GPU-floor")
    for k, v in rows.items():
        print(f"{k:44}{v['median_ms']:8.3f}m{v['p90_ms']:8.3f}m{v['p99_ms']:8.3f}m"
              f"  {v['median_ms'] / 1.0:13.2f}  {v['median_ms'] / GPU_STEP_FLOOR_MS:16.2f}")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
