"""Start and stop a whole mesh (`meshllm serve`) for a benchmark: free ports, wait for /health."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.ports import free_port  # noqa: E402


def start(model_dir: str, *extra: str, ready_timeout_s: float = 300.0) -> tuple[subprocess.Popen, str, str]:
    """(launcher process, http base url, its log path)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="meshllm-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "serve", model_dir, "--port", str(port),
                             "--grpc-port", str(free_port()), *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 and "meshllm services:" in open(log.name).read():
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the mesh did not start: see {log.name}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
