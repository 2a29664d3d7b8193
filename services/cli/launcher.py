"""Start the whole mesh (worker, tokenizer, scheduler, gateway) as child processes and
stop every one of them on Ctrl-C / SIGTERM, or if the launcher itself is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from services.common.ports import free_port
from services.common.procs import die_with_parent


@dataclass
class MeshConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    served_model_name: str = "smollm2-135m-instruct"
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0
    num_kv_blocks: int = 0                 # 0: sized from kv_cache_memory_gb
    chat_template: str | None = None
    embedding_model_dir: str | None = None  # a BERT dir served by an embedder; None: no embeddings
    reasoning_parser: str | None = None    # gateway --reasoning-parser
    tool_call_parser: str | None = None    # gateway --tool-call-parser
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    simulate_worker: bool = False          # no-compute worker (services/worker/simulated.py)
    simulate_step_ms: float = 0.0
    ready_timeout_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)
    gateway_args: list[str] = field(default_factory=list)  # API keys, TLS, limits (security.py)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError(f"{self.model_dir!r} is not a model directory (no config.json)")
        if self.embedding_model_dir and not os.path.isfile(
                os.path.join(self.embedding_model_dir, "config.json")):
            raise ValueError(f"--embedding-model {self.embedding_model_dir!r} is not a model "
                             "directory (no config.json)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")


class Mesh:
    """The four services as processes. `start()` returns once every one is ready."""

    def __init__(self, cfg: MeshConfig) -> None:
        self.cfg = cfg
        self.procs: dict[str, subprocess.Popen] = {}
        self._tmp = tempfile.mkdtemp(prefix="meshllm-")
        self.tokenizer_port = free_port()
        self.scheduler_port = free_port()
        self.worker_grpc_port = free_port()
        self.worker_addr = f"ipc://{self._tmp}/worker.ipc"
        self.embedder_port = free_port() if cfg.embedding_model_dir else None

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {**os.environ, **self.cfg.extra_env, "MESHLLM_PARENT_PID": str(os.getpid()),
               "PYTHONUNBUFFERED": "1"}
        self.procs[name] = subprocess.Popen([sys.executable, "-m", f"services.{name}", *args], env=env,
                                            preexec_fn=die_with_parent, stdin=subprocess.DEVNULL)

    def start(self) -> None:
        c, h = self.cfg, self.cfg.host
        engine_args = ["--max-model-len", str(c.max_model_len)]
        self._spawn("worker", ["--model", c.model_dir, "--zmq-addr", self.worker_addr, "--host", "127.0.0.1",
                               "--grpc-port", str(self.worker_grpc_port), "--device", c.device, "--dtype", c.dtype,
                               "--kv-cache-memory-gb", str(c.kv_cache_memory_gb),
                               *(["--num-kv-blocks", str(c.num_kv_blocks)] if c.num_kv_blocks else []),
                               "--served-model-name", c.served_model_name, *engine_args,
                               *(["--simulate", "--simulate-step-ms", str(c.simulate_step_ms)]
                                 if c.simulate_worker else [])])
        tok_args = ["--model", c.model_dir, "--host", "127.0.0.1", "--port", str(self.tokenizer_port)]
        if c.chat_template:
            tok_args += ["--chat-template", c.chat_template]
        self._spawn("tokenizer", tok_args)
        self._spawn("scheduler", ["--worker-addr", self.worker_addr, "--host", "127.0.0.1",
                                  "--port", str(self.scheduler_port), "--max-num-seqs", str(c.max_num_seqs),
                                  "--max-num-batched-tokens", str(c.max_num_batched_tokens),
                                  "--block-size", str(c.block_size), "--served-model-name", c.served_model_name,
                                  "--scheduling-policy", c.scheduling_policy,
                                  "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
                                  "--async-scheduling" if c.async_scheduling else "--no-async-scheduling",
                                  *engine_args])
        embedder_args = []
        if c.embedding_model_dir:
            self._spawn("embedder", ["--model", c.embedding_model_dir, "--host", "127.0.0.1",
                                     "--port", str(self.embedder_port), "--device", c.device])
            embedder_args = ["--embedder-addr", f"127.0.0.1:{self.embedder_port}"]
        self._spawn("gateway", [*embedder_args, "--host", h, "--port", str(c.port), "--grpc-port", str(c.grpc_port),
                                "--tokenizer-addr", f"127.0.0.1:{self.tokenizer_port}",
                                "--engine-addr", f"127.0.0.1:{self.scheduler_port}",
                                "--served-model-name", c.served_model_name,
                                *(["--reasoning-parser", c.reasoning_parser] if c.reasoning_parser else []),
                                *(["--tool-call-parser", c.tool_call_parser] if c.tool_call_parser else []),
                                *c.gateway_args])
        self._wait_ready()

    def _wait_ready(self) -> None:
        import asyncio

        from services.common.grpc_server import wait_ready
        checks = [("worker", f"127.0.0.1:{self.worker_grpc_port}"), ("tokenizer", f"127.0.0.1:{self.tokenizer_port}"),
                  ("scheduler", f"127.0.0.1:{self.scheduler_port}"), ("gateway", f"{self.cfg.host}:{self.cfg.grpc_port}")]
        if self.embedder_port is not None:
            checks.append(("embedder", f"127.0.0.1:{self.embedder_port}"))
        deadline = time.monotonic() + self.cfg.ready_timeout_s

        async def wait_all() -> None:
            for name, addr in checks:
                if name == "gateway" and "--ssl-certfile" in self.cfg.gateway_args:
                    await self._wait_listening(addr, deadline)  # TLS: a plain health check can't
                    continue
                while True:
                    self.check_alive()
                    try:
                        await wait_ready(addr, name, timeout_s=2.0)
                        break
                    except TimeoutError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{name} not ready after {self.cfg.ready_timeout_s:.0f}s") from None

        asyncio.run(wait_all())

    async def _wait_listening(self, addr: str, deadline: float) -> None:
        import asyncio
        host, port = addr.rsplit(":", 1)
        while True:
            self.check_alive()
            try:
                _, writer = await asyncio.open_connection(host, int(port))
                writer.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("gateway not listening in time") from None
                await asyncio.sleep(0.2)

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"service {name} exited with code {p.returncode}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM everyone (gateway first, so no new work arrives), then SIGKILL stragglers."""
        for name in ("gateway", "embedder", "scheduler", "tokenizer", "worker"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        import shutil
        shutil.rmtree(self._tmp, ignore_errors=True)


def run_mesh(cfg: MeshConfig) -> int:
    """Start the mesh, print where it listens, and supervise until a signal or a death."""
    mesh = Mesh(cfg)
    stopping = {"sig": None}

    def on_signal(signum, frame):
        stopping["sig"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        mesh.start()
        print(f"meshllm is up: OpenAI API http://{cfg.host}:{cfg.port}/v1 (health: /health), "
              f"gRPC {cfg.host}:{cfg.grpc_port}, model {cfg.served_model_name!r}. Ctrl-C stops it.", flush=True)
        print(f"meshllm services: tokenizer=127.0.0.1:{mesh.tokenizer_port} scheduler=127.0.0.1:{mesh.scheduler_port} "
              f"worker={mesh.worker_addr} worker-health=127.0.0.1:{mesh.worker_grpc_port}"
              + (f" embedder=127.0.0.1:{mesh.embedder_port}" if mesh.embedder_port else ""), flush=True)
        while True:
            mesh.check_alive()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("meshllm: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"meshllm: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        mesh.stop()
