"""The worker service with `--tensor-parallel-size 2` as real processes, driven over ZMQ, vs tp=1
in-process: greedy tokens (fp32 and bf16, CUDA graphs on; one plan at a time and two in flight,
which rank 0 pipelines on GPUs), where the ranks run, and what a rank's death does. Runs on CPU (gloo) or 2 GPUs (NCCL); needs no gRPC client (readiness = hello answered).
  NCCL_NVLS_ENABLE=0 python3 -m tests.gpu.tp_worker --device cuda OUT_JSON
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from services.common import pb
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.gpu.greedy_driver import compare, greedy_with_top2
from tests.unit.tiny_llama import make_tiny_llama

PROMPTS = [[5, 9, 11, 40, 7, 3, 22, 61, 17], [8, 8, 30], [70, 2, 44, 12, 90, 13], [33] * 20]
NEW, BLOCKS, BS = 16, 64, 16


class Conn:
    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def call(self, req: pb.step.WorkerRequest, timeout_s: float = 300.0) -> pb.step.WorkerReply:
        self.sock.send(req.SerializeToString())
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("worker did not reply")
        reply = pb.step.WorkerReply()
        reply.ParseFromString(self.sock.recv())
        return reply

    @property
    def block_size(self) -> int:
        return BS

    def execute(self, plan: pb.step.StepPlan) -> pb.step.StepResult:
        return self.call(pb.step.WorkerRequest(plan=plan)).result

    # Two plans in flight, as the scheduler's async scheduling sends them: the worker's engine loop
    # then submits step N+1 before replying to step N (replies come back in order).
    def submit(self, plan: pb.step.StepPlan) -> int:
        self.sock.send(pb.step.WorkerRequest(plan=plan).SerializeToString())
        return plan.step_id

    def collect(self, _pending, timeout_s: float = 300.0) -> pb.step.StepResult:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("worker did not reply")
        reply = pb.step.WorkerReply()
        reply.ParseFromString(self.sock.recv())
        return reply.result


def children(pid: int) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = Path(f"/proc/{e}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(e))
    return out


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_worker(model: Path, device: str, dtype: str, tp: int, tmp: Path, tag: str):
    addr = f"ipc://{tmp}/{tag}.ipc"
    cmd = [sys.executable, "-m", "services.worker", "--model", str(model), "--zmq-addr", addr,
           "--device", device, "--dtype", dtype, "--num-kv-blocks", str(BLOCKS), "--block-size", str(BS),
           "--tensor-parallel-size", str(tp)]
    log = open(tmp / f"{tag}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), addr


def gpu_apps() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("out")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tpw-"))
    model = make_tiny_llama(tmp / "m", seed=7)
    ref_dev = "cuda:0" if a.device == "cuda" else "cpu"
    report: dict = {"device": a.device}
    for dtype in ("float32", "bfloat16") if a.device == "cuda" else ("float32",):
        ref = ModelRunner(load_model(model, ref_dev, getattr(torch, dtype)), model_name="tiny", kv_cache_bytes=0,
                          num_kv_blocks=BLOCKS, block_size=BS)
        ref.hello(BS)
        ref_t, ref_top = greedy_with_top2(ProtoRunner(ref), PROMPTS, NEW)
        t0 = time.monotonic()
        proc, addr = start_worker(model, a.device, dtype, 2, tmp, f"w_{dtype}")
        conn = Conn(addr)
        entry: dict = {}
        try:
            info = conn.call(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=BS))).info
            entry["ready_s"] = round(time.monotonic() - t0, 1)
            entry["info"] = {"num_kv_blocks": info.num_kv_blocks, "device": info.device}
            ranks = children(proc.pid)
            entry["rank_pids"] = [proc.pid, *ranks]
            got_t, got_top = greedy_with_top2(conn, PROMPTS, NEW)
            entry["vs_tp1"] = compare(ref_t, ref_top, got_t, got_top)
            pipe_t, _ = greedy_with_top2(conn, PROMPTS, NEW, pipelined=True)
            entry["pipelined_equals_unpipelined"] = pipe_t == got_t
            entry["gpu_apps"] = gpu_apps()
            if dtype == "float32":  # a rank's death takes the worker down
                os.kill(ranks[0], signal.SIGKILL)
                rc = proc.wait(60)
                entry["after_rank1_killed"] = {"worker_rc": rc}
            else:
                t1 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                entry["sigterm_rc"] = proc.wait(60)
                entry["stop_s"] = round(time.monotonic() - t1, 1)
                time.sleep(1.0)  # a killed orphan is reaped by init, not by us
                entry["ranks_left"] = [p for p in ranks if running(p)]
        except Exception as exc:  # noqa: BLE001 - reported
            entry["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            entry["log_tail"] = (tmp / f"w_{dtype}.log").read_text()[-3000:]
        report[dtype] = entry
        print(json.dumps({k: v for k, v in entry.items() if k not in ("log_tail",)}, default=str)[:3000], flush=True)
    # A size that the GPUs or the heads cannot hold fails fast with a clear message.
    proc, _ = start_worker(model, a.device, "float32", 4, tmp, "w_bad")
    report["tp4"] = {"rc": proc.wait(120), "log_tail": (tmp / "w_bad.log").read_text()[-600:]}
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
