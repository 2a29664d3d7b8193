"""Start the real mesh (`meshllm serve`) as processes on free 127.0.0.1 ports, and stop it."""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from services.common.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry))
    return kids


def descendants_of(pid: int) -> list[int]:
    """Every process below `pid`, breadth first (children before grandchildren)."""
    found, level = [], [pid]
    while level:
        level = [kid for parent in level for kid in children_of(parent)]
        found += level
    return found


def service_name(pid: int) -> str:
    """`worker` for `python -m services.worker ...`; "" when it is not one of ours (or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return ""
    for i, arg in enumerate(argv[:-1]):
        if arg == b"-m" and argv[i + 1].startswith(b"services."):
            return argv[i + 1].decode().removeprefix("services.")
    return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


@dataclass
class MeshProcess:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    model_name: str

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    log_path: str = ""

    def services(self) -> dict[str, str]:
        """Internal addresses the launcher printed (tokenizer, scheduler, worker, worker-health)."""
        with open(self.log_path) as f:
            for line in f:
                if line.startswith("meshllm services:"):
                    return dict(kv.split("=", 1) for kv in line.split(":", 1)[1].split())
        raise RuntimeError("the launcher did not print its services line")

    def service_pids(self) -> list[int]:
        """Every process of the mesh below the launcher: the supervisor, the services it
        runs, and their own children (tensor-parallel ranks)."""
        return descendants_of(self.proc.pid)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_mesh(model_dir: str, *extra: str, ready_timeout_s: float = 300.0, attempts: int = 2) -> MeshProcess:
    """Start `meshllm serve` on fresh ports and wait for /health. A mesh that dies while
    starting (say, a port taken by an unrelated process in between) is tried once more."""
    for attempt in range(attempts):
        try:
            return _start_mesh_once(model_dir, extra, ready_timeout_s)
        except MeshExited:
            if attempt == attempts - 1:
                raise


class MeshExited(RuntimeError):
    pass


def _start_mesh_once(model_dir: str, extra: tuple[str, ...], ready_timeout_s: float) -> MeshProcess:
    import tempfile
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "services.cli.main", "serve", model_dir, "--port", str(http_port),
           "--grpc-port", str(grpc_port), "--served-model-name", "smollm2-135m-instruct", *extra]
    log = tempfile.NamedTemporaryFile(prefix="meshllm-launcher-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log)
    mesh = MeshProcess(proc, http_port, grpc_port, "smollm2-135m-instruct", log.name)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise MeshExited(f"the mesh exited with code {proc.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(f"{mesh.http_url}/health", timeout=2) as r:
                if r.status == 200 and "meshllm services:" in open(mesh.log_path).read():
                    return mesh
        except (OSError, http.client.HTTPException):   # not up yet, or not the gateway answering yet
            pass
        if time.monotonic() > deadline:
            mesh.stop()
            raise TimeoutError("the mesh did not become ready in time")
        time.sleep(0.3)


def stop_checked(mesh: MeshProcess, seen: set[int], grace_s: float = 15.0) -> None:
    """Stop a module's mesh: the launcher exits 0 and no process it ever ran (`seen`, restarted
    ones included) outlives it; stragglers are killed, then reported."""
    seen |= set(mesh.service_pids())
    assert mesh.stop() == 0
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in seen):
        time.sleep(0.2)
    left = [p for p in seen if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes left after the mesh stopped: {left}"
