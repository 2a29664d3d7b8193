"""tp=2 over NCCL on two GPUs gives the tp=1 greedy tokens (bf16, Triton kernels, CUDA graphs with
the all-reduces captured, then eager). Run on a 2-GPU machine:
  NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m tests.gpu.tp_nccl OUT_JSON
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.tp import init_tp, shard_model
from tests.unit.tiny_llama import make_tiny_llama
from tests.worker_driver import MiniScheduler

PROMPTS = [[5, 9, 11, 40, 7, 3, 22, 61, 17], [8, 8, 30], [70, 2, 44, 12, 90, 13], [33] * 20]


def greedy(model, eager: bool) -> dict:
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=64, block_size=16,
                         enforce_eager=eager)
    runner.hello(16)
    sched = MiniScheduler(runner.execute, 16, 64, budget=16)
    for i, p in enumerate(PROMPTS):
        sched.add(f"r{i}", p, 16)
    return sched.run()


def main() -> int:
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(f"cuda:{rank}")
    path = make_tiny_llama(Path(tempfile.mkdtemp()), seed=7)  # same seed: same weights on each rank
    full = load_model(path, dev, torch.bfloat16)
    ref = greedy(full, eager=False) if rank == 0 else None
    group = init_tp(rank, world, dev)
    shard = shard_model(full, rank, world, group)
    res = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        try:
            res[mode] = greedy(shard, eager)
        except Exception as exc:  # noqa: BLE001 - report, do not hang the other rank
            res[mode] = f"{type(exc).__name__}: {exc}"[:500]
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))  # files, not pickled objects
    dist.barrier()
    if rank == 0:
        gathered = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
        report = {"tp1": ref, "tp2": gathered,
                  "match_graphs": all(g["graphs"] == ref for g in gathered),
                  "match_eager": all(g["eager"] == ref for g in gathered)}
        Path(out).write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report[k] for k in ("match_graphs", "match_eager")}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
