"""The worker's host time per decode step at N rows, with the model's forward and logits replaced by
empty tensors (so only the host's work is left): the plan in (a pb StepPlan, as the engine loop
hands it over), validation, state updates, the GPU executor's input staging (numpy into the
staging buffers), the sampling rows, the sampled ids read back and the pb StepResult out; the
pipelined order of the engine loop (step N+1 submitted before step N is collected). On a GPU this
work overlaps the previous step's forward: it is hidden while it stays under the step's GPU time
(a 512-row decode step of the 8B shape is ~22 ms on an H200), and it is CPU time the worker's
process takes from the host's other services either way.

  .venv/bin/python bench/host_step_cost.py [--rows 256,512] [--steps 40] [--profile]

CPU only (the executor's CUDA parts are not used: no graphs, plain staging buffers).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.common import pb  # noqa: E402
from services.common.gc_heap import freeze_startup_heap  # noqa: E402
from services.worker import gpu_exec  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from services.worker.wire import ProtoRunner  # noqa: E402
from tests.unit.tiny_llama import make_tiny_llama  # noqa: E402

BS, CTX = 16, 1536


def no_forward(model, ids, positions, attn, kv_caches, src=None, prev=None):
    return torch.zeros(ids.shape[0], model.cfg.hidden_size, dtype=model.dtype)


def no_logits(model, hidden):
    return torch.zeros(hidden.shape[0], model.cfg.vocab_size, dtype=torch.float32)


def measure(model, rows: int, steps: int, profile: bool) -> dict:
    per = -(-(CTX + steps + 8) // BS)
    runner = ModelRunner(model, model_name="host", kv_cache_bytes=0, num_kv_blocks=rows * per + 8, block_size=BS)
    runner.hello(BS)
    runner.gpu = gpu_exec.GpuExecutor(model, runner.kv_caches, BS, max_num_tokens=max(2048, rows),
                                      max_num_seqs=rows, graph_sizes=None)
    wired = ProtoRunner(runner)
    ids = [f"r{i}" for i in range(rows)]
    plan = pb.step.StepPlan(step_id=1)
    for i, rid in enumerate(ids):
        plan.new_requests.add(request_id=rid, token_ids=[5] * CTX, block_ids=range(i * per, (i + 1) * per),
                              num_computed_tokens=CTX - 1, num_scheduled_tokens=1,
                              sampling=pb.common.SamplingParams(temperature=0.0, ignore_eos=True))
    wired.execute(plan)
    freeze_startup_heap()
    plans = []
    for s in range(steps):
        p = pb.step.StepPlan(step_id=2 + s)
        for rid in ids:
            p.cached_requests.add(request_id=rid, num_computed_tokens=CTX + s, num_scheduled_tokens=1)
        plans.append(p)
    prof = cProfile.Profile() if profile else None
    times, pending = [], None
    if prof:
        prof.enable()
    for p in plans:
        t0 = time.perf_counter()
        nxt = wired.submit(p)
        if pending is not None:
            res = wired.collect(pending)
            assert not res.HasField("error") and len(res.outputs) == rows
        times.append(time.perf_counter() - t0)
        pending = nxt
    wired.collect(pending)
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue()[:4000])
    return {"rows": rows, "host_ms_per_step_median": statistics.median(times[2:]) * 1e3,
            "host_us_per_row": statistics.median(times[2:]) * 1e6 / rows}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="256,512")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args()
    gpu_exec.forward_triton = no_forward
    gpu_exec.compute_logits_triton = no_logits
    model = load_model(make_tiny_llama(Path(tempfile.mkdtemp()), max_pos=4096))
    res = {"bench": "host_step_cost", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": os.cpu_count(), "runs": []}
    for rows in (int(x) for x in a.rows.split(",")):
        r = measure(model, rows, a.steps, a.profile)
        print(json.dumps(r), flush=True)
        res["runs"].append(r)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
