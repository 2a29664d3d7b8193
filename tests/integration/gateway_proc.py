"""A second gateway process with its own flags (API keys, TLS, limits) in front of the shared
mesh's tokenizer and scheduler: cheap (no model load), real sockets."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.integration.meshproc import ROOT


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: str

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)


def start_gateway(mesh, *flags: str, env: dict | None = None, timeout_s: float = 60) -> GatewayProcess:
    svc = mesh.services()
    log = tempfile.NamedTemporaryFile(prefix="meshllm-gw-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "services.gateway", "--port", "0", "--grpc-port", "0",
           "--tokenizer-addr", svc["tokenizer"], "--engine-addr", svc["scheduler"],
           "--served-model-name", mesh.model_name, *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log.name, errors="replace") as f:
            text = f.read()
        http = re.search(r"gateway http listening on https?://[^:]+:(\d+)", text)
        grpc_ = re.search(r"gateway grpc listening on [^:]+:(\d+)", text)
        if http and grpc_ and "readiness: ready" in text:
            return GatewayProcess(proc, int(http.group(1)), int(grpc_.group(1)), log.name)
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"the gateway did not become ready:\n{text[-3000:]}")
