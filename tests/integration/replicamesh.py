"""A mesh with several engine replicas (simulated workers) and tokenizers, started as plain
processes so a test can kill, stop or restart any one of them, and a gateway routing among
them (`--engine-addr` repeated). Each process logs to its own file; `served_by(id)` reads the
schedulers' per-request log lines to say which replica ran a request."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from services.common.ports import free_port
from tests.integration.meshproc import ROOT


@dataclass
class Proc:
    name: str
    args: list[str]
    log_path: str
    addr: str = ""
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen([sys.executable, "-m", *self.args], cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class Replica:
    worker: Proc
    scheduler: Proc
    addr: str


@dataclass
class ReplicaMesh:
    replicas: list[Replica]
    tokenizers: list[Proc]
    gateway: Proc
    tmp: str
    http_port: int = 0
    grpc_port: int = 0
    extra: list[Proc] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def procs(self) -> list[Proc]:
        return [self.gateway, *self.tokenizers, *(p for r in self.replicas
                                                  for p in (r.scheduler, r.worker)), *self.extra]

    def served_by(self, request_id: str) -> list[int]:
        """Indexes of the replicas whose scheduler logged `request_id` as completed (stop or
        length; a replica that failed or aborted it does not count)."""
        pat = re.compile(rf"request {re.escape(request_id)}(-\d+)? finished reason=(stop|length)")
        return [i for i, r in enumerate(self.replicas) if pat.search(r.scheduler.log())]

    def times_routable(self, index: int) -> int:
        """How often the gateway logged replica `index` becoming routable."""
        return self.gateway.log().count(f"engine replica {self.replicas[index].addr} is routable")

    def wait_routable(self, count: int, timeout_s: float = 60.0) -> None:
        """Until the gateway has logged `count` replicas becoming routable."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(set(re.findall(r"engine replica (\S+) is routable", self.gateway.log()))) >= count:
                return
            time.sleep(0.1)
        raise TimeoutError(f"fewer than {count} replicas routable:\n{self.gateway.log()[-3000:]}")

    def stop(self) -> None:
        for p in self.procs():
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs():
            if p.popen is not None:
                try:
                    p.popen.wait(15)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()


def start_replica_mesh(model_dir: str, num_engines: int = 2, num_tokenizers: int = 1, *,
                       step_ms: float = 20.0, gateway_flags: tuple[str, ...] = (),
                       scheduler_flags: tuple[str, ...] = (), worker_flags: tuple[str, ...] = (),
                       timeout_s: float = 90.0) -> ReplicaMesh:
    tmp = tempfile.mkdtemp(prefix="meshllm-replicas-")
    replicas, tokenizers = [], []
    for i in range(num_engines):
        zmq = f"ipc://{tmp}/worker{i}.ipc"
        port = free_port()
        worker = Proc(f"worker{i}", ["services.worker", "--model", model_dir, "--zmq-addr", zmq,
                                     "--grpc-port", str(free_port()), "--simulate",
                                     "--simulate-step-ms", str(step_ms),
                                     "--num-kv-blocks", "2048", *worker_flags],
                      f"{tmp}/worker{i}.log")
        sched = Proc(f"scheduler{i}", ["services.scheduler", "--worker-addr", zmq, "--port",
                                       str(port), *scheduler_flags], f"{tmp}/scheduler{i}.log")
        replicas.append(Replica(worker, sched, f"127.0.0.1:{port}"))
    for i in range(num_tokenizers):
        port = free_port()
        tokenizers.append(Proc(f"tokenizer{i}", ["services.tokenizer", "--model", model_dir,
                                                 "--port", str(port)], f"{tmp}/tokenizer{i}.log",
                               addr=f"127.0.0.1:{port}"))
    gw_args = ["services.gateway", "--port", "0", "--grpc-port", "0",
               "--served-model-name", "smollm2-135m-instruct"]
    for r in replicas:
        gw_args += ["--engine-addr", r.addr]
    for t in tokenizers:
        gw_args += ["--tokenizer-addr", t.addr]
    gateway = Proc("gateway", [*gw_args, *gateway_flags], f"{tmp}/gateway.log")
    mesh = ReplicaMesh(replicas, tokenizers, gateway, tmp)
    for p in mesh.procs()[::-1]:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            text = gateway.log()
            http = re.search(r"gateway http listening on https?://[^:]+:(\d+)", text)
            grpc_ = re.search(r"gateway grpc listening on [^:]+:(\d+)", text)
            if http and grpc_:
                mesh.http_port, mesh.grpc_port = int(http.group(1)), int(grpc_.group(1))
                break
            dead = [p.name for p in mesh.procs() if not p.alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"replica mesh did not start (dead: {dead}):\n{text[-3000:]}")
            time.sleep(0.1)
        mesh.wait_routable(num_engines, max(1.0, deadline - time.monotonic()))
    except BaseException:
        mesh.stop()
        raise
    return mesh
