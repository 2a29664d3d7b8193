"""`--tensor-parallel-size` end to end on the CPU (gloo): a tp=2 mesh answers the OpenAI API with
the tp=1 tokens, stops cleanly with every rank, and a worker whose rank dies goes down."""
from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from openai import OpenAI

from services.common import pb
from services.common.procs import die_with_parent
from tests.integration.meshproc import ROOT, alive, children_of, start_mesh
from tests.unit.tiny_llama import make_tiny_llama

PROMPTS = ["The history of the printing press", "def fibonacci(n):", "Photosynthesis is the process"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    """A random 2-layer Llama (6 heads / 2 KV heads) over SmolLM2's vocabulary and tokenizer:
    loads in milliseconds, and its 6/2 heads split over 2 ranks but not over 3 or 4."""
    path = make_tiny_llama(tmp_path_factory.mktemp("tp") / "tiny", seed=11, vocab=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


def _completions(mesh) -> list[tuple[str, str]]:
    client = OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)
    out = []
    for prompt in PROMPTS:
        greedy = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        seeded = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=12, temperature=0.9,
                                           seed=1234, extra_body={"ignore_eos": True})
        assert greedy.usage.completion_tokens == seeded.usage.completion_tokens == 12
        out.append((greedy.choices[0].text, seeded.choices[0].text))
    return out


def _worker_and_ranks(mesh) -> tuple[int, list[int]]:
    """Rank 0 (the worker the supervisor runs) and the rank processes it started."""
    for pid in mesh.service_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"services.worker" in argv and b"--tp-rank" not in argv:
            return pid, children_of(pid)
    raise AssertionError("no worker process under the launcher")


def _serve_and_stop(model_dir, tp: int) -> tuple[list[tuple[str, str]], list[int]]:
    """A tp-rank mesh's completions, and the pids of it (ranks included) still alive once its
    launcher exited 0 on SIGTERM."""
    mesh = start_mesh(str(model_dir), "--max-model-len", "256", "--num-kv-blocks", "128",
                      "--tensor-parallel-size", str(tp), ready_timeout_s=120)
    try:
        worker, ranks = _worker_and_ranks(mesh)
        assert len(ranks) == tp - 1, "rank 0 starts one process per other rank"
        results = _completions(mesh)
        pids = [*mesh.service_pids(), *ranks]
    finally:
        rc = mesh.stop()
    assert rc == 0, f"tp={tp}: the launcher exited with {rc} on SIGTERM"
    return results, [p for p in pids if alive(p)]


def test_tp2_mesh_gives_the_tp1_tokens_and_stops_with_every_rank(tiny_dir):
    with ThreadPoolExecutor(2) as pool:   # the two meshes start and serve at once
        runs = {tp: pool.submit(_serve_and_stop, tiny_dir, tp) for tp in (1, 2)}
        (results1, left1), (results2, left2) = runs[1].result(), runs[2].result()
    assert results2 == results1
    assert all(g and s for g, s in results1)  # 12 tokens of text each
    assert not left1 + left2, "ranks or services left running after the mesh stopped"


def _start_worker(model_dir, tmp_path, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.worker", "--model", str(model_dir),
           "--zmq-addr", f"ipc://{tmp_path}/w.ipc", "--num-kv-blocks", "64", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_size_that_does_not_split_the_kv_heads_is_refused_with_the_reason(tiny_dir, tmp_path):
    proc = _start_worker(tiny_dir, tmp_path, "--tensor-parallel-size", "3")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "tensor parallel size 3 must divide num_heads 6, num_kv_heads 2" in err
    assert "Traceback" not in err


def test_smollm2_does_not_split_over_two_ranks(smollm2_dir, tmp_path):
    """SmolLM2-135M has 9 heads / 3 KV heads: tp=2 is refused before anything loads."""
    proc = _start_worker(smollm2_dir, tmp_path, "--tensor-parallel-size", "2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "must divide num_heads 9, num_kv_heads 3" in err


def test_a_rank_that_dies_takes_the_worker_down(tiny_dir, tmp_path):
    proc = _start_worker(tiny_dir, tmp_path, "--tensor-parallel-size", "2")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        deadline, line = time.monotonic() + 120, ""
        while "worker listening" not in line:
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        sock.connect(re.search(r"zmq=(\S+)", line).group(1))
        sock.send(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=16)).SerializeToString())
        assert sock.poll(120_000), "no answer to hello"  # every rank has loaded its shard
        reply = pb.step.WorkerReply.FromString(sock.recv())
        assert reply.info.num_kv_blocks == 64
        (rank1,) = children_of(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "tensor-parallel rank 1 exited with code -9" in proc.stderr.read()
    finally:
        sock.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
