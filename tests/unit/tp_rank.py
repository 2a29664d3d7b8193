"""One tensor-parallel rank for test_worker_tp.py: `python -m tests.unit.tp_rank MODEL_DIR RANK
WORLD PORT OUT_JSON` runs fixed greedy requests through ModelRunner on its shard (gloo) and writes
the sampled tokens as JSON."""
from __future__ import annotations

import json
import sys

import torch

from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.tp import init_tp, shard_model
from services.worker.wire import ProtoRunner
from tests.worker_driver import MiniScheduler

PROMPTS = [[5, 9, 11, 40, 7, 3, 22, 61, 17], [8, 8, 30], [70, 2, 44, 12, 90, 13]]


def run(model) -> dict:
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=32, block_size=4)
    runner.hello(4)
    sched = MiniScheduler(ProtoRunner(runner).execute, 4, 32, budget=7)  # chunked prefill + mixed steps
    for i, p in enumerate(PROMPTS):
        sched.add(f"r{i}", p, 8)
    return sched.run()


def main(argv: list[str]) -> int:
    model_dir, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    torch.set_num_threads(1)
    group = init_tp(rank, world, torch.device("cpu"), f"tcp://127.0.0.1:{port}")
    model = shard_model(load_model(model_dir), rank, world, group)
    tokens = run(model)
    with open(out, "w") as f:
        json.dump(tokens, f)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
