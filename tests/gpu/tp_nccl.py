"""tp=2 over NCCL on two GPUs vs tp=1: greedy tokens in bf16 and fp32 (Triton kernels, CUDA graphs
with the all-reduces captured, and eager), the ranks agreeing, and the top-2 gap at any divergence. Run on a 2-GPU machine:
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
from services.worker.wire import ProtoRunner
from tests.unit.tiny_llama import make_tiny_llama
from tests.gpu.greedy_driver import compare, greedy_with_top2

PROMPTS = [[5, 9, 11, 40, 7, 3, 22, 61, 17], [8, 8, 30], [70, 2, 44, 12, 90, 13], [33] * 20]


def greedy(model, eager: bool):
    """-> (tokens, top2) through ModelRunner.execute behind the wire edge (tests/gpu/greedy_driver.py)."""
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=64, block_size=16,
                         enforce_eager=eager)
    runner.hello(16)
    return greedy_with_top2(ProtoRunner(runner), PROMPTS, 16)


def main() -> int:
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(f"cuda:{rank}")
    path = make_tiny_llama(Path(tempfile.mkdtemp()), seed=7)  # same seed: same weights on each rank
    fulls = {dt: load_model(path, dev, getattr(torch, dt)) for dt in ("bfloat16", "float32")}
    refs = {dt: greedy(m, eager=False) for dt, m in fulls.items()} if rank == 0 else None
    group = init_tp(rank, world, dev)
    res = {}
    for dt, full in fulls.items():
        shard = shard_model(full, rank, world, group)
        for mode, eager in (("graphs", False), ("eager", True)):
            try:
                res[f"{dt}_{mode}"] = greedy(shard, eager)
            except Exception as exc:  # noqa: BLE001 - report, do not hang the other rank
                res[f"{dt}_{mode}"] = f"{type(exc).__name__}: {exc}"[:500]
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))  # files, not pickled objects
    dist.barrier()
    if rank == 0:
        gathered = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
        report = {"ranks_agree": all(g == gathered[0] for g in gathered)}
        for key, val in gathered[0].items():
            dt = key.split("_")[0]
            ref_t, ref_top = refs[dt]
            report[key] = val if isinstance(val, str) else compare(ref_t, ref_top, val[0], val[1])
        Path(out).write_text(json.dumps(report, indent=1))
        print(json.dumps({k: (v if isinstance(v, (bool, str)) else [v["matches"], v["prompts"],
                          [r for r in v["rows"] if not r["match"]]]) for k, v in report.items()}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
