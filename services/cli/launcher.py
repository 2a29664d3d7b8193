"""Start the whole mesh (worker, tokenizer, scheduler, gateway, ...) under one supervisor
(services/supervisor), which starts, health-checks and restarts every service; stop all of
them on Ctrl-C / SIGTERM, or if the launcher itself is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from services.common import pb
from services.common.ports import free_port
from services.common.ports import reserve as reserve_ports
from services.common.procs import die_with_parent

METRICS_SERVICES = ("tokenizer", "scheduler", "worker", "embedder", "profiler", "kvstore")

# --api-server-count auto: one gateway process per this many cores, at most AUTO_API_SERVERS_MAX.
# A gateway process keeps about one core busy at its peak; the tokenizers, schedulers, workers and
# the kernel need the others, so a small host keeps one process (it cannot feed a second).
CORES_PER_AUTO_API_SERVER = 8
AUTO_API_SERVERS_MAX = 4


def resolve_api_server_count(value: str, num_cores: int) -> int:
    """`--api-server-count`: a whole number >= 1, or "auto" = min(4, cores // 8), at least 1
    (1 up to 15 cores, 2 from 16, 3 from 24, 4 from 32). ValueError for anything else."""
    if value.strip().lower() == "auto":
        return max(1, min(AUTO_API_SERVERS_MAX, num_cores // CORES_PER_AUTO_API_SERVER))
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"--api-server-count must be a whole number >= 1 or 'auto', got {value!r}") from None
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1 (or 'auto'), got {count}")
    return count


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
    kv_cache_dtype: str = "auto"           # worker --kv-cache-dtype: auto, fp8, fp8_e4m3
    quantization: str = "none"             # worker --quantization: none, fp8
    speculative_config: str = ""           # scheduler + worker --speculative-config (JSON; "": off)
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
    tensor_parallel_size: int = 1          # worker ranks (services/worker/tp_ranks.py)
    ready_timeout_s: float = 300.0
    data_parallel_size: int = 1            # engine replicas (a scheduler + its worker each)
    api_server_count: int = 1              # gateway processes sharing the public ports (SO_REUSEPORT)
    tokenizer_replicas: int = 1
    progress_timeout_s: float = 30.0       # scheduler: work pending, no step this long -> not ready
    stop_grace_s: float = 20.0             # shutdown: in-flight requests get this long
    extra_env: dict[str, str] = field(default_factory=dict)
    otlp_traces_endpoint: str | None = None  # OTLP/gRPC collector; None: tracing off (unless OTEL_* env)
    trace_sampling_ratio: float | None = None  # None: OTEL_TRACES_SAMPLER_ARG or 1.0
    gateway_args: list[str] = field(default_factory=list)  # API keys, TLS, limits (security.py)
    internal_mtls: str | None = None       # None: plain internal hops; "auto" or a dev-ca DIR
    profile_dir: str = ""                  # profiler traces (worker + profiler); "": their default
    kv_tier: bool = True                   # start a kvstore, the secondary KV tier (docs/kvstore.md)
    kv_tier_capacity_gb: float = 1.0       # its host memory (hard bound, LRU)
    kv_tier_disk_dir: str = ""             # its disk spill ("" = none)
    kv_tier_disk_gb: float = 0.0
    kv_tier_backend: str = "memory"        # or redis://HOST:PORT
    kvstore_addr: str = ""                 # an external kvstore instead of starting one
    kv_offload_gb: float = 0.0             # tier 1 per worker: host memory for evicted blocks (0: off)
    kv_load_timeout_ms: float = 2000.0     # kvstore fetches cut short after this (recomputed)
    # Prefill/decode disaggregation (docs/pd.md): P prefill engines (engine-0 .. P-1) and D
    # decode engines (engine-P ..) instead of --data-parallel-size colocated ones.
    prefill_replicas: int = 0
    decode_replicas: int = 0
    kv_load_failure_policy: str = "recompute"
    kv_handoff: str = "direct"             # direct (peer worker's mapped cache) or kvstore
    kv_lease_s: float = 30.0               # direct: a hand-off's blocks held at most this long
    kv_direct_transport: str = "mmap"      # direct: mmap / CUDA IPC (one host), nixl, or auto (both)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError(f"{self.model_dir!r} is not a model directory (no config.json)")
        if not self.simulate_worker:   # an architecture the worker cannot serve: before any process
            from services.common.model_architectures import check_model_dir
            check_model_dir(self.model_dir)
        if self.embedding_model_dir and not os.path.isfile(
                os.path.join(self.embedding_model_dir, "config.json")):
            raise ValueError(f"--embedding-model {self.embedding_model_dir!r} is not a model "
                             "directory (no config.json)")
        if self.trace_sampling_ratio is not None and not 0.0 <= self.trace_sampling_ratio <= 1.0:
            raise ValueError(f"--trace-sampling-ratio must be in [0, 1], got {self.trace_sampling_ratio}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.internal_mtls not in (None, "auto"):
            from services.cli.internal_security import check_dir
            check_dir(self.internal_mtls)
        if self.kvstore_addr:
            from services.common.kv_blocks import check_kvstore_addr
            check_kvstore_addr(self.kvstore_addr)
        elif self.kv_tier:  # its flags are checked here, before any process starts
            from services.kvstore.config import KvStoreConfig
            try:
                KvStoreConfig(port=0, capacity_gb=self.kv_tier_capacity_gb, disk_dir=self.kv_tier_disk_dir,
                              disk_gb=self.kv_tier_disk_gb, backend=self.kv_tier_backend)
            except ValueError as exc:  # the kvstore's flag names, as --kv-tier-* here
                raise ValueError(str(exc).replace("--", "--kv-tier-")) from None
        if (isinstance(self.api_server_count, bool) or not isinstance(self.api_server_count, int)
                or self.api_server_count < 1):
            raise ValueError(f"--api-server-count must be a whole number >= 1, got {self.api_server_count!r}")
        if self.data_parallel_size < 1 or self.tokenizer_replicas < 1:
            raise ValueError("--data-parallel-size and --tokenizer-replicas must be >= 1")
        if self.prefill_replicas or self.decode_replicas:
            if self.prefill_replicas < 1 or self.decode_replicas < 1:
                raise ValueError("--prefill-replicas and --decode-replicas go together, each >= 1")
            if self.data_parallel_size > 1:
                raise ValueError("--data-parallel-size (colocated engines) and --prefill-replicas / "
                                 "--decode-replicas (disaggregated ones) are alternatives: give one")
            if self.kv_handoff == "kvstore" and not (self.kv_tier or self.kvstore_addr):
                raise ValueError("--kv-handoff kvstore hands the KV over through the kvstore: "
                                 "drop --no-kv-tier or give --kvstore-addr")
            # Tensor parallel: every engine gets the one --tensor-parallel-size, so prefill and decode
            # ranks pair up (rank r hands over to rank r; unequal sizes are refused at hand-off).
            self.data_parallel_size = self.prefill_replicas + self.decode_replicas
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("--kv-load-failure-policy must be recompute or fail")
        if self.kv_handoff not in ("direct", "kvstore"):
            raise ValueError("--kv-handoff must be direct or kvstore")
        if self.kv_lease_s <= 0:
            raise ValueError("--kv-lease-s must be positive")
        if self.progress_timeout_s <= 0 or self.stop_grace_s <= 0:
            raise ValueError("--progress-timeout-s and --shutdown-grace-s must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        from services.worker.config import KV_CACHE_DTYPES, QUANTIZATIONS
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        from services.common.spec_config import check_served
        check_served(self.speculative_config, self.tensor_parallel_size, self.model_dir)   # before any process


# Services other than the scheduler answer health on the event loop that carries their
# traffic: a load burst can delay a probe by seconds, so they count as hung only after this
# long without an answer (the scheduler's health port has threads of its own: 5 s there).
LOOP_HEALTH_HANG_S = 30.0


@dataclass
class EnginePorts:
    """Where one data-parallel engine replica (a scheduler and its worker) listens; the
    supervisor restarts it on the same ports."""

    rank: int
    scheduler_port: int
    scheduler_health_port: int   # grpc.health.v1 on its own thread (services/common/health_thread.py)
    worker_grpc_port: int
    worker_addr: str


class Mesh:
    """The supervisor and, under it, every service as a replica. `start()` returns once
    every replica is ready; the supervisor restarts any that fail afterwards."""

    def __init__(self, cfg: MeshConfig) -> None:
        self.cfg = cfg
        self.procs: dict[str, subprocess.Popen] = {}
        self._tmp = tempfile.mkdtemp(prefix="meshllm-")
        self.internal = None  # InternalSecurity with --internal-mtls: certificates, CURVE keys
        if cfg.internal_mtls is not None:
            from services.cli.internal_security import InternalSecurity
            self.internal = InternalSecurity(cfg.internal_mtls, self._tmp)
        reserve_ports(cfg.port, cfg.grpc_port)   # the public ports asked for: no service of ours gets them
        self.engines = [EnginePorts(i, free_port(), free_port(), free_port(), f"ipc://{self._tmp}/worker-{i}.ipc")
                        for i in range(cfg.data_parallel_size)]
        self.tokenizer_ports = [free_port() for _ in range(cfg.tokenizer_replicas)]
        # Replica 0's addresses under their old names (tests and tools read these).
        self.tokenizer_port = self.tokenizer_ports[0]
        self.scheduler_port = self.engines[0].scheduler_port
        self.worker_grpc_port = self.engines[0].worker_grpc_port
        self.worker_addr = self.engines[0].worker_addr
        self.embedder_port = free_port() if cfg.embedding_model_dir else None
        self.profiler_port = free_port()
        self.kvstore_port = free_port() if cfg.kv_tier and not cfg.kvstore_addr else None
        self.supervisor_port = free_port()
        # The public ports: every gateway process binds the same ones (SO_REUSEPORT), so with
        # several a port 0 is chosen here, once, for all of them.
        self.http_port, self.grpc_port = cfg.port, cfg.grpc_port
        if cfg.api_server_count > 1:
            probe = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") or ":" in cfg.host else cfg.host
            self.http_port = self.http_port or free_port(probe)
            self.grpc_port = self.grpc_port or free_port(probe)
        # Each gateway process's own-thread health (never starved): the supervisor probes each.
        self.gateway_health_ports = [free_port() for _ in range(cfg.api_server_count)]
        self.gateway_health_port = self.gateway_health_ports[0]
        # With several gateway processes, their metrics files (services/gateway/shared_metrics.py).
        self.gateway_metrics_dir = ""
        if cfg.api_server_count > 1:
            self.gateway_metrics_dir = os.path.join(self._tmp, "gateway-metrics")
            os.mkdir(self.gateway_metrics_dir, 0o700)
        # Prometheus /metrics of the gRPC-only services (the gateway serves it on its HTTP
        # port). A new service that accepts --metrics-port joins by adding its name here.
        # Replicas past the first are "<name>-<rank>".
        self.metrics_ports = {name: free_port() for name in METRICS_SERVICES
                              if (name != "embedder" or cfg.embedding_model_dir)
                              and (name != "kvstore" or self.kvstore_port)}
        for i in range(1, cfg.data_parallel_size):
            for name in ("scheduler", "worker"):
                if name in self.metrics_ports:
                    self.metrics_ports[f"{name}-{i}"] = free_port()
        for i in range(1, cfg.tokenizer_replicas):
            if "tokenizer" in self.metrics_ports:
                self.metrics_ports[f"tokenizer-{i}"] = free_port()
        self.metrics_ports["supervisor"] = free_port()

    @property
    def kvstore_address(self) -> str:
        """The KV tier the engines are told about: ours, an external one, or "" (off)."""
        if self.cfg.kvstore_addr:
            return self.cfg.kvstore_addr
        return f"127.0.0.1:{self.kvstore_port}" if self.kvstore_port else ""

    @property
    def supervisor_addr(self) -> str:
        return f"127.0.0.1:{self.supervisor_port}"

    def _child_env(self, name: str) -> dict[str, str]:
        """What a child's environment adds to the supervisor's."""
        env = {**self.cfg.extra_env, **self._tracing_env()}
        if self.internal is not None:  # this child's certificate
            env.update(self.internal.child_env(name))
        return env

    def _process(self, name: str, args: list[str], replica: str = "", extra_env: dict[str, str] | None = None,
                 **health) -> "pb.supervisor.ProcessSpec":
        """One child as the supervisor will run it: `python -m services.<name> args`."""
        from services.cli.supervised import process
        key = replica or name
        if key in self.metrics_ports:
            args = [*args, "--metrics-port", str(self.metrics_ports[key])]
        if self.internal is not None:  # CURVE keys for the ZMQ link
            args = [*args, *self.internal.child_args(name)]
        return process(name, args, {**self._child_env(name), **(extra_env or {})}, **health)

    def _spawn(self, name: str, args: list[str]) -> None:
        from services.cli.internal_security import without_internal_tls_env
        env = {**without_internal_tls_env(dict(os.environ)), **self._child_env(name),
               "MESHLLM_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        # Its own process group: Ctrl-C in a terminal signals the whole foreground group, and
        # the supervisor must get one orderly SIGTERM from us, not SIGINT and SIGTERM at once
        # (a second signal means "exit now").
        self.procs[name] = subprocess.Popen([sys.executable, "-m", f"services.{name}", *args], env=env,
                                            preexec_fn=die_with_parent, stdin=subprocess.DEVNULL,
                                            process_group=0)

    def _tracing_env(self) -> dict[str, str]:
        # Every service (present and future) reads the standard OTEL_* variables in
        # telemetry.init_service, so the environment reaches them all without new flags.
        env = {}
        if self.cfg.otlp_traces_endpoint:
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = self.cfg.otlp_traces_endpoint
        if self.cfg.trace_sampling_ratio is not None:
            env["OTEL_TRACES_SAMPLER_ARG"] = repr(float(self.cfg.trace_sampling_ratio))
        return env

    def _worker_device(self, dp_rank: int) -> str:
        """Data-parallel replica d gets its own GPUs: cuda:(d*T) .. cuda:(d*T + T - 1) for
        --tensor-parallel-size T (its worker's rank r runs on cuda:(d*T + r))."""
        c = self.cfg
        return c.device if c.device != "cuda" or dp_rank == 0 else f"cuda:{dp_rank * c.tensor_parallel_size}"

    def role_of(self, rank: int) -> str:
        """An engine's kv_role (docs/pd.md): prefill engines first, then decode ones."""
        c = self.cfg
        if not c.prefill_replicas:
            return ""
        return "prefill" if rank < c.prefill_replicas else "decode"

    def _engine_replica(self, e: EnginePorts) -> "pb.supervisor.ReplicaSpec":
        c = self.cfg
        suffix = f"-{e.rank}" if e.rank else ""
        role = self.role_of(e.rank)
        engine_args = ["--max-model-len", str(c.max_model_len),
                       *(["--kvstore-addr", self.kvstore_address] if self.kvstore_address else []),
                       *(["--speculative-config", c.speculative_config] if c.speculative_config else [])]
        worker = self._process("worker", [
            "--model", c.model_dir, "--zmq-addr", e.worker_addr, "--host", "127.0.0.1",
            "--grpc-port", str(e.worker_grpc_port), "--device", self._worker_device(e.rank), "--dtype", c.dtype,
            "--kv-cache-memory-gb", str(c.kv_cache_memory_gb), "--kv-cache-dtype", c.kv_cache_dtype,
            *(["--quantization", c.quantization] if c.quantization != "none" else []),
            *(["--num-kv-blocks", str(c.num_kv_blocks)] if c.num_kv_blocks else []),
            *(["--kv-offload-gb", str(c.kv_offload_gb)] if c.kv_offload_gb else []),
            *(["--kv-export", "--kv-direct-transport", c.kv_direct_transport] if role and c.kv_handoff == "direct"
              else []),
            *(["--kv-load-timeout-ms", str(c.kv_load_timeout_ms)] if self.kvstore_address else []),
            "--served-model-name", c.served_model_name, *engine_args,
            *(["--tensor-parallel-size", str(c.tensor_parallel_size)] if c.tensor_parallel_size > 1 else []),
            *(["--simulate", "--simulate-step-ms", str(c.simulate_step_ms)] if c.simulate_worker else []),
            *(["--profile-dir", c.profile_dir] if c.profile_dir else []), "--engine-id", str(e.rank)],
            replica=f"worker{suffix}")
        # The scheduler's readiness covers its worker (hello answered, steps progressing), so
        # the supervisor probes the scheduler's own health thread and watches the worker's pid.
        scheduler = self._process("scheduler", [
            "--worker-addr", e.worker_addr, "--host", "127.0.0.1", "--port", str(e.scheduler_port),
            "--health-port", str(e.scheduler_health_port), "--progress-timeout-s", str(c.progress_timeout_s),
            "--shutdown-grace-s", str(c.stop_grace_s), "--engine-id", str(e.rank),
            "--max-num-seqs", str(c.max_num_seqs), "--max-num-batched-tokens", str(c.max_num_batched_tokens),
            "--block-size", str(c.block_size), "--served-model-name", c.served_model_name,
            "--scheduling-policy", c.scheduling_policy,
            "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
            "--async-scheduling" if c.async_scheduling else "--no-async-scheduling", *engine_args,
            *(["--kv-role", role, "--kv-load-failure-policy", c.kv_load_failure_policy,
               "--kv-lease-s", str(c.kv_lease_s)] if role else [])],
            replica=f"scheduler{suffix}", health_addr=f"127.0.0.1:{e.scheduler_health_port}",
            health_service="scheduler")
        return pb.supervisor.ReplicaSpec(
            id=f"engine-{e.rank}", kind=pb.supervisor.REPLICA_KIND_ENGINE, rank=e.rank,
            addr=f"127.0.0.1:{e.scheduler_port}", processes=[worker, scheduler], restart_when_unready=True,
            metrics_url=self.metrics_url(f"scheduler{suffix}"), role=role)

    def metrics_url(self, key: str) -> str:
        """The /metrics URL of one service replica ("worker", "scheduler-1", ...), "" if it has none."""
        port = self.metrics_ports.get(key)
        return f"http://127.0.0.1:{port}/metrics" if port else ""

    def _replicas(self) -> list["pb.supervisor.ReplicaSpec"]:
        c, h = self.cfg, self.cfg.host
        K = pb.supervisor
        replicas = [*self._kvstore_replicas(), *(self._engine_replica(e) for e in self.engines)]
        for i, port in enumerate(self.tokenizer_ports):
            tok_args = ["--model", c.model_dir, "--host", "127.0.0.1", "--port", str(port)]
            if c.chat_template:
                tok_args += ["--chat-template", c.chat_template]
            key = f"tokenizer-{i}" if i else "tokenizer"
            replicas.append(K.ReplicaSpec(
                id=f"tokenizer-{i}", kind=K.REPLICA_KIND_TOKENIZER, rank=i, addr=f"127.0.0.1:{port}",
                unhealthy_after_s=LOOP_HEALTH_HANG_S,
                processes=[self._process("tokenizer", tok_args, replica=key, health_addr=f"127.0.0.1:{port}",
                                         health_service="tokenizer")],
                metrics_url=self.metrics_url(key)))
        embedder_args = []
        if c.embedding_model_dir:
            addr = f"127.0.0.1:{self.embedder_port}"
            replicas.append(K.ReplicaSpec(
                id="embedder-0", kind=K.REPLICA_KIND_EMBEDDER, addr=addr, unhealthy_after_s=LOOP_HEALTH_HANG_S,
                processes=[self._process("embedder", ["--model", c.embedding_model_dir, "--host", "127.0.0.1",
                                                      "--port", str(self.embedder_port), "--device", c.device],
                                         health_addr=addr, health_service="embedder")],
                metrics_url=self.metrics_url("embedder")))
            embedder_args = ["--embedder-addr", addr]
        replicas.append(self._profiler_replica())
        # Last in the spec (the supervisor stops the gateways first and the rest after them).
        return [*replicas, *self._gateway_replicas(embedder_args)]

    def _gateway_replicas(self, embedder_args: list[str]) -> list["pb.supervisor.ReplicaSpec"]:
        """--api-server-count gateway processes, one replica each (the supervisor probes and
        restarts each alone), all on the same public ports, with the same engines, tokenizers
        and supervisor to follow: the same routing view."""
        c, h, K = self.cfg, self.cfg.host, pb.supervisor
        probe_host = "127.0.0.1" if h in ("0.0.0.0", "::", "") else h
        shared = ["--reuse-port"] if c.api_server_count > 1 else []
        env = {"PROMETHEUS_MULTIPROC_DIR": self.gateway_metrics_dir} if self.gateway_metrics_dir else None
        replicas = []
        for i, health_port in enumerate(self.gateway_health_ports):
            # Probed on its health thread's port (plain, or internal mTLS like every internal
            # port), which answers even when request traffic saturates the gateway's event loop
            # and says NOT_SERVING when that loop stalls; the public port may use public TLS.
            gateway = self._process("gateway", [
                *embedder_args, "--profiler-addr", f"127.0.0.1:{self.profiler_port}", "--host", h,
                "--port", str(self.http_port), "--grpc-port", str(self.grpc_port), *shared,
                "--health-port", str(health_port),
                *[a for e in self.engines for a in ("--engine-addr", f"127.0.0.1:{e.scheduler_port}")],
                *[a for p in self.tokenizer_ports for a in ("--tokenizer-addr", f"127.0.0.1:{p}")],
                "--supervisor-addr", self.supervisor_addr, "--shutdown-grace-s", str(c.stop_grace_s),
                "--served-model-name", c.served_model_name,
                *(["--reasoning-parser", c.reasoning_parser] if c.reasoning_parser else []),
                *(["--tool-call-parser", c.tool_call_parser] if c.tool_call_parser else []),
                *c.gateway_args],
                extra_env=env, health_addr=f"{probe_host}:{health_port}", health_service="gateway",
                probe=K.PROBE_GRPC_HEALTH)
            # /metrics answers for every gateway process (shared_metrics.py): listed once, on
            # gateway-0, so that a scraper discovering targets here counts each series once.
            metrics_url = (f"http{'s' if '--ssl-certfile' in c.gateway_args else ''}://"
                           f"{probe_host}:{self.http_port}/metrics") if i == 0 else ""
            replicas.append(K.ReplicaSpec(id=f"gateway-{i}", kind=K.REPLICA_KIND_GATEWAY, rank=i,
                                          addr=f"{probe_host}:{self.grpc_port}",
                                          unhealthy_after_s=LOOP_HEALTH_HANG_S,
                                          processes=[gateway], metrics_url=metrics_url))
        return replicas

    def _kvstore_replicas(self) -> list["pb.supervisor.ReplicaSpec"]:
        """The kvstore (docs/kvstore.md), unless the tier is off or external."""
        if self.kvstore_port is None:
            return []
        c = self.cfg
        addr = f"127.0.0.1:{self.kvstore_port}"
        args = ["--host", "127.0.0.1", "--port", str(self.kvstore_port), "--capacity-gb", str(c.kv_tier_capacity_gb),
                "--backend", c.kv_tier_backend,
                *(["--disk-dir", c.kv_tier_disk_dir, "--disk-gb", str(c.kv_tier_disk_gb)] if c.kv_tier_disk_dir else [])]
        return [pb.supervisor.ReplicaSpec(
            id="kvstore-0", kind=pb.supervisor.REPLICA_KIND_KVSTORE, addr=addr, unhealthy_after_s=LOOP_HEALTH_HANG_S,
            processes=[self._process("kvstore", args, health_addr=addr, health_service="kvstore")],
            metrics_url=self.metrics_url("kvstore"))]

    def _profiler_replica(self) -> "pb.supervisor.ReplicaSpec":
        from services.profiler.launch import profiler_argv
        # Every replica's TelemetryControl (replica 0 under the plain names, as in services_line).
        services = {}
        for i, port in enumerate(self.tokenizer_ports):
            services[f"tokenizer-{i}" if i else "tokenizer"] = f"127.0.0.1:{port}"
        for e in self.engines:
            suffix = f"-{e.rank}" if e.rank else ""
            services[f"scheduler{suffix}"] = f"127.0.0.1:{e.scheduler_port}"
            services[f"worker{suffix}"] = f"127.0.0.1:{e.worker_grpc_port}"
        if self.embedder_port is not None:
            services["embedder"] = f"127.0.0.1:{self.embedder_port}"
        if self.kvstore_port is not None:
            services["kvstore"] = f"127.0.0.1:{self.kvstore_port}"
        workers = {f"worker{e.rank}": f"127.0.0.1:{e.worker_grpc_port}" for e in self.engines}
        args, env = profiler_argv(self.profiler_port, workers, services,
                                  f"{self.cfg.host}:{self.grpc_port}", self.cfg.gateway_args,
                                  {**os.environ, **self.cfg.extra_env}, self.cfg.profile_dir)
        addr = f"127.0.0.1:{self.profiler_port}"
        return pb.supervisor.ReplicaSpec(
            id="profiler-0", kind=pb.supervisor.REPLICA_KIND_PROFILER, addr=addr,
            unhealthy_after_s=LOOP_HEALTH_HANG_S,
            processes=[self._process("profiler", args, extra_env=env, health_addr=addr, health_service="profiler")],
            metrics_url=self.metrics_url("profiler"))

    def start(self) -> None:
        from services.cli.supervised import write_spec
        spec_path = os.path.join(self._tmp, "supervisor-spec.json")
        write_spec(spec_path, self._replicas())
        self._spawn("supervisor", ["--spec", spec_path, "--host", "127.0.0.1", "--port", str(self.supervisor_port),
                                   "--metrics-port", str(self.metrics_ports["supervisor"]),
                                   "--stop-grace-s", str(self.cfg.stop_grace_s + 5),
                                   "--startup-timeout-s", str(self.cfg.ready_timeout_s),
                                   # An engine that lost its progress already waited that long.
                                   "--unready-after-s", str(min(10.0, self.cfg.progress_timeout_s))])
        self._wait_ready()

    def _wait_ready(self) -> None:
        import asyncio

        from services.cli.supervised import wait_replicas_ready
        creds = self.internal.client_credentials() if self.internal is not None else None
        asyncio.run(wait_replicas_ready(self.supervisor_addr, creds, self.cfg.ready_timeout_s, self.check_alive))

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"service {name} exited with code {p.returncode}")

    def services_line(self) -> str:
        """`name=addr ...` of the internal services (replica 0 under the plain names)."""
        parts = [f"tokenizer=127.0.0.1:{self.tokenizer_port}", f"scheduler=127.0.0.1:{self.scheduler_port}",
                 f"worker={self.worker_addr}", f"worker-health=127.0.0.1:{self.worker_grpc_port}"]
        if self.embedder_port:
            parts.append(f"embedder=127.0.0.1:{self.embedder_port}")
        if self.kvstore_address:
            parts.append(f"kvstore={self.kvstore_address}")
        parts += [f"profiler=127.0.0.1:{self.profiler_port}", f"supervisor={self.supervisor_addr}",
                  f"gateway-health=127.0.0.1:{self.gateway_health_port}"]
        parts += [f"gateway-health-{i}=127.0.0.1:{p}" for i, p in enumerate(self.gateway_health_ports) if i]
        for e in self.engines[1:]:
            parts += [f"scheduler-{e.rank}=127.0.0.1:{e.scheduler_port}", f"worker-{e.rank}={e.worker_addr}"]
        parts += [f"tokenizer-{i}=127.0.0.1:{p}" for i, p in enumerate(self.tokenizer_ports) if i]
        parts += [f"{name}-metrics=127.0.0.1:{port}" for name, port in self.metrics_ports.items()]
        return " ".join(parts)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the supervisor: it stops the gateway first (in-flight requests finish),
        then the rest. SIGKILL if that takes longer than the grace allows; its children
        still get SIGTERM from the kernel then (PR_SET_PDEATHSIG)."""
        timeout_s = self.cfg.stop_grace_s + 30 if timeout_s is None else timeout_s
        for p in self.procs.values():
            if p.poll() is None:
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
        gateways = f" ({cfg.api_server_count} gateway processes)" if cfg.api_server_count > 1 else ""
        print(f"meshllm is up: OpenAI API http://{cfg.host}:{mesh.http_port}/v1 (health: /health), "
              f"gRPC {cfg.host}:{mesh.grpc_port}{gateways}, model {cfg.served_model_name!r}. Ctrl-C stops it.",
              flush=True)
        print(f"meshllm services: {mesh.services_line()}", flush=True)
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
