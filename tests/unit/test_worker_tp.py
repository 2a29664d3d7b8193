"""Tensor parallel on the CPU (gloo, 2 processes): tp=2 samples the same greedy tokens as tp=1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.models import load_model
from services.worker.models.config import ModelConfigError
from services.worker.tp import shard_model
from tests.unit.tiny_llama import make_tiny_llama
from tests.unit.tp_rank import run
from services.common.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_over_gloo_gives_the_tp1_greedy_tokens(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m", seed=7)
    want = run(load_model(model_dir))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.tp_rank", str(model_dir), str(r), "2", str(port),
                               str(tmp_path / f"rank{r}.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out.decode()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] == want


def test_shard_rejects_a_size_that_does_not_divide_the_heads(tmp_path):
    model = load_model(make_tiny_llama(tmp_path, seed=1))  # 6 q heads, 2 kv heads
    with pytest.raises(ModelConfigError, match="must divide"):
        shard_model(model, 0, 3)


def test_worker_config_places_ranks_and_rejects_bad_tp_flags(tmp_path):
    from services.worker.config import WorkerConfig
    (tmp_path / "config.json").write_text("{}")
    cfg = WorkerConfig(model=str(tmp_path), zmq_addr="ipc:///tmp/x", device="cuda", tensor_parallel_size=2,
                       tp_rank=1, tp_init_method="tcp://127.0.0.1:1234")
    assert cfg.rank_device == "cuda:1"
    second = WorkerConfig(model=str(tmp_path), zmq_addr="ipc:///tmp/x", device="cuda:2", tensor_parallel_size=2,
                          tp_rank=1, tp_init_method="tcp://127.0.0.1:1234")
    assert second.rank_device == "cuda:3"  # a data-parallel replica's ranks start at its first GPU
    cpu = WorkerConfig(model=str(tmp_path), zmq_addr="ipc:///tmp/x", tensor_parallel_size=2, num_threads=0)
    assert cpu.rank_device == "cpu" and cpu.threads >= 1
    for bad, match in [(dict(tensor_parallel_size=0), "tensor-parallel-size"),
                       (dict(tensor_parallel_size=2, simulate=True), "not --simulate"),
                       (dict(tensor_parallel_size=2, device="cuda:x"), "cuda:N"),
                       (dict(tensor_parallel_size=2, tp_rank=2), "outside"),
                       (dict(tensor_parallel_size=2, tp_rank=1), "init method")]:
        with pytest.raises(ValueError, match=match):
            WorkerConfig(model=str(tmp_path), zmq_addr="ipc:///tmp/x", **bad)
