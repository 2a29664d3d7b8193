"""The worker as a real process, driven over ZMQ with handmade StepPlans on SmolLM2."""
from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq

from services.common import pb
from services.common.grpc_server import wait_ready
from services.common.procs import die_with_parent
from tests.worker_driver import MiniScheduler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 16
NUM_BLOCKS = 256

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make glucose and release oxygen. It happens mostly in the leaves.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Write a short poem about the sea at night, the sound of waves and the light of the moon.",
    "A hash table stores key-value pairs in an array, using a hash function to compute the index "
    "of the bucket where each key belongs.",
]


class WorkerConn:
    def __init__(self, zmq_addr: str, grpc_addr: str, info: pb.step.WorkerInfo) -> None:
        self.zmq_addr, self.grpc_addr, self.info = zmq_addr, grpc_addr, info
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(zmq_addr)

    def call_raw(self, payload: bytes, timeout_s: float = 120.0) -> pb.step.WorkerReply:
        self.sock.send(payload)
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("worker did not reply")
        reply = pb.step.WorkerReply()
        reply.ParseFromString(self.sock.recv())
        return reply

    def call(self, req: pb.step.WorkerRequest) -> pb.step.WorkerReply:
        return self.call_raw(req.SerializeToString())

    def hello(self, block_size: int = BLOCK) -> pb.step.WorkerInfo:
        return self.call(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=block_size))).info

    def execute(self, plan: pb.step.StepPlan) -> pb.step.StepResult:
        reply = self.call(pb.step.WorkerRequest(plan=plan))
        assert reply.HasField("result")
        return reply.result

    def scheduler(self, budget: int = 2048) -> MiniScheduler:
        return MiniScheduler(self.execute, BLOCK, NUM_BLOCKS, budget)


@pytest.fixture(scope="module")
def worker(smollm2_dir, tmp_path_factory):
    cmd = [sys.executable, "-m", "services.worker", "--model", str(smollm2_dir),
           "--zmq-addr", "tcp://127.0.0.1:0", "--grpc-port", "0", "--max-model-len", "1024",
           "--num-kv-blocks", str(NUM_BLOCKS), "--served-model-name", "smol"]
    log_path = tmp_path_factory.mktemp("worker-log") / "stderr.log"
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=log_file,
                            text=True, preexec_fn=die_with_parent)
    try:
        deadline, line = time.monotonic() + 60, ""
        while "worker listening" not in line:
            assert proc.poll() is None, f"worker exited with {proc.returncode}"
            assert time.monotonic() < deadline, "worker did not print its addresses"
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        m = re.search(r"grpc=(\S+) zmq=(\S+)", line)
        grpc_addr, zmq_addr = m.group(1), m.group(2)
        asyncio.run(wait_ready(grpc_addr, "worker", timeout_s=120))
        conn = WorkerConn(zmq_addr, grpc_addr, pb.step.WorkerInfo())
        conn.info = conn.hello()
        conn.log_path = log_path
        yield conn
        conn.sock.close(0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "worker did not exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_file.close()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))


def test_the_worker_freezes_its_startup_heap_before_it_is_ready(worker):
    """gc.freeze() once the model is loaded (services/common/gc_heap.py): full collections never
    walk the start-up objects again, and a step's short-lived containers trigger none."""
    from services.common.gc_heap import GEN0_THRESHOLD
    m = re.search(r"froze (\d+) start-up objects.*first threshold (\d+)", worker.log_path.read_text())
    assert m and int(m.group(1)) > 10_000
    assert int(m.group(2)) == GEN0_THRESHOLD


def test_hello_reports_the_model_and_cache(worker, smollm2_dir):
    info = worker.info
    assert (info.num_kv_blocks, info.block_size, info.max_model_len) == (NUM_BLOCKS, BLOCK, 1024)
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
    assert info.model_name == "smol" and info.device == "cpu"


def test_greedy_tokens_equal_transformers_generate(worker, smollm2_dir, tokenizer):
    import concurrent.futures as cf

    from transformers import AutoModelForCausalLM
    prompts = [tokenizer.encode(t).ids for t in TEXTS]
    sched = worker.scheduler(budget=64)  # prompts arrive in chunks, mixed with decodes
    for i, p in enumerate(prompts):
        sched.add(f"p{i}", p, 20)
    # The worker process runs the plans (driven from a thread: only it touches the socket) while
    # this process computes the reference on the other core.
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(sched.run)
        hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # exactly 20 tokens, like ignore_eos
        expected = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # spinning OpenMP threads next to the worker process are 4x slower
        try:
            for p in prompts:
                with torch.no_grad():
                    out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=20, do_sample=False, pad_token_id=2)
                expected.append(out[0, len(p):].tolist())
        finally:
            torch.set_num_threads(threads)
        got = running.result()
    assert [got[f"p{i}"] for i in range(len(prompts))] == expected


def test_sixteen_batched_requests_equal_their_solo_outputs(worker, tokenizer):
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    # 16 prompts of 16 different lengths (3..78 tokens), cut from the texts above.
    prompts = [(ids[i % 5] * 3)[i % 3: i % 3 + 3 + 5 * i] for i in range(16)]
    assert len({len(p) for p in prompts}) == 16
    new_tokens = 8
    solo = []
    for i, p in enumerate(prompts):
        s = worker.scheduler()
        s.add(f"solo{i}", p, new_tokens)
        solo.append(s.run()[f"solo{i}"])
    batched = worker.scheduler()
    for i, p in enumerate(prompts):
        batched.add(f"b{i}", p, new_tokens)
    first = batched.step()
    assert len(first.outputs) == 16 and all(len(o.token_ids) == 1 for o in first.outputs)
    got = batched.run()
    assert [got[f"b{i}"] for i in range(16)] == solo


def test_bad_messages_get_error_replies_and_the_worker_keeps_serving(worker, tokenizer):
    garbage = worker.call_raw(b"\xff\x00not a protobuf")
    assert garbage.HasField("result") and garbage.result.HasField("error")
    bad = pb.step.StepPlan(step_id=5)
    bad.cached_requests.add(request_id="nobody", num_computed_tokens=0, num_scheduled_tokens=1)
    result = worker.execute(bad)
    assert result.step_id == 5 and result.error.code == pb.common.ERROR_CODE_INVALID_ARGUMENT
    bad = pb.step.StepPlan(step_id=6)
    bad.new_requests.add(request_id="big", token_ids=[1] * 8, block_ids=[NUM_BLOCKS + 5],
                         num_scheduled_tokens=8)
    assert worker.execute(bad).HasField("error")
    s = worker.scheduler()
    s.add("after", tokenizer.encode(TEXTS[0]).ids, 3)
    assert len(s.run()["after"]) == 3
