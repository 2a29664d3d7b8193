"""The ranks of a tensor-parallel worker (`--tensor-parallel-size N`).

Rank 0 is the worker process the launcher started: it owns the ZMQ socket and the gRPC health
server, and it starts ranks 1..N-1 as child processes (`python -m services.worker ... --tp-rank r`).
Every rank loads the model, keeps its shard (tp.py) and allocates the KV cache of its own heads,
so `--kv-cache-memory-gb` is per rank and every rank computes the same number of blocks.

Each WorkerRequest that rank 0 receives is fanned out as its serialized protobuf bytes: a
broadcast of the length (int64), then of the bytes (uint8), over a gloo group (the CPU side
even when the model's all-reduces run on NCCL). Every rank then runs the same request; only
rank 0 answers the scheduler. Length 0 is a heartbeat that keeps idle ranks inside the
collectives' timeout; -1 tells them to stop. Nothing is pickled.

Unseeded requests draw their base seed from one rng that rank 0 seeds and broadcasts at start,
so every rank samples the same tokens and keeps the same token lists.

Failure is all-or-nothing: a rank that exits makes rank 0 exit (its watcher thread), rank 0
exiting kills the others (PR_SET_PDEATHSIG), and a step that fails inside the runner on any
rank is fatal there (engine.TpStepFailed), because the ranks may now disagree or wait in a
collective forever.

Imports: this module uses the engine (follower_main runs its `handle`); the engine never imports
this one back (it only holds the TpLink that serve() hands it).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from services.common.ports import free_port
from services.common.procs import die_with_parent
from services.worker.config import WorkerConfig
from services.worker.engine import Engine, LoadFailed, Runner
from services.worker.models.config import ModelConfigError, load_model_config
from services.worker.tp import check_tp_size, init_tp

log = logging.getLogger("meshllm.worker.tp")

HEARTBEAT_S = 10.0        # idle rank 0 pings the others this often
CLOSE_TIMEOUT_S = 3.0     # a clean stop must fit the 15 s hard-exit timer of install_stop_handlers
COLLECTIVE_TIMEOUT_S = 1800.0  # rendezvous, loading and any one collective (the heartbeat is far below)
_STOP = -1


class TpLink:
    """This rank's place in the group and the channel every WorkerRequest travels on."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.rank, self.size, self.init_method = cfg.tp_rank, cfg.tensor_parallel_size, cfg.tp_init_method
        self.group = None          # the model's all-reduces (NCCL on CUDA, gloo on CPU)
        self.cpu_group = None      # the plan fan-out (gloo)
        self.seed_rng: random.Random | None = None
        self._len = torch.zeros(1, dtype=torch.int64)
        self._last_send = time.monotonic()

    def connect(self, device: torch.device) -> None:
        self.group = init_tp(self.rank, self.size, device, self.init_method, timeout_s=COLLECTIVE_TIMEOUT_S)
        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else self.group
        seed = torch.tensor([random.SystemRandom().getrandbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(seed, 0, group=self.cpu_group)
        self.seed_rng = random.Random(int(seed.item()))
        log.info("tensor-parallel rank %d/%d joined (%s)", self.rank, self.size, dist.get_backend(self.group))

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    # ---- rank 0 ------------------------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        self._send_len(len(payload))
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.cpu_group)

    def heartbeat(self) -> None:
        if time.monotonic() - self._last_send >= HEARTBEAT_S:
            self._send_len(0)

    def send_stop(self) -> None:
        self._send_len(_STOP)

    def _send_len(self, n: int) -> None:
        self._len[0] = n
        dist.broadcast(self._len, 0, group=self.cpu_group)
        self._last_send = time.monotonic()

    # ---- ranks > 0 ---------------------------------------------------------------------------
    def recv(self) -> bytes | None:
        """The next WorkerRequest's bytes; b"" for a heartbeat; None when rank 0 stops."""
        dist.broadcast(self._len, 0, group=self.cpu_group)
        n = int(self._len.item())
        if n == _STOP:
            return None
        if n == 0:
            return b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.cpu_group)
        return buf.numpy().tobytes()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Tear the groups down; False if that did not finish in time. (Seen on 2 H200s: a worker
        with NCCL did not finish its SIGTERM stop; the process exits right after this anyway.)"""
        if not dist.is_initialized():
            return True
        t = threading.Thread(target=dist.destroy_process_group, name="tp-close", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            log.warning("tensor-parallel rank %d: process group teardown still running after %.0fs; "
                        "exiting without it", self.rank, timeout_s)
            return False
        log.info("tensor-parallel rank %d: process group closed", self.rank)
        return True


def preflight(cfg: WorkerConfig) -> None:
    """Clear errors before any rank starts: the split must be even and the GPUs must exist."""
    check_tp_size(load_model_config(cfg.model), cfg.tensor_parallel_size)
    if cfg.device.startswith("cuda"):
        need, have = cfg.first_gpu + cfg.tensor_parallel_size, torch.cuda.device_count()
        if have < need:
            raise ModelConfigError(f"--tensor-parallel-size {cfg.tensor_parallel_size} on --device {cfg.device} "
                                   f"needs GPUs up to cuda:{need - 1}, {have} visible")


def _rank_args(cfg: WorkerConfig, rank: int) -> list[str]:
    return ["--model", cfg.model, "--zmq-addr", cfg.zmq_addr, "--device", cfg.device, "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_model_len), "--kv-cache-memory-gb", str(cfg.kv_cache_memory_gb),
            "--kv-cache-dtype", cfg.kv_cache_dtype,
            "--num-kv-blocks", str(cfg.num_kv_blocks), "--block-size", str(cfg.block_size),
            "--served-model-name", cfg.served_model_name, "--num-threads", str(cfg.num_threads),
            *(["--enforce-eager"] if cfg.enforce_eager else []),
            "--tensor-parallel-size", str(cfg.tensor_parallel_size),
            "--tp-rank", str(rank), "--tp-init-method", cfg.tp_init_method]


class RankProcesses:
    """Ranks 1..N-1 as child processes, and a watcher per rank that ends rank 0 if one dies."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.stopping = threading.Event()
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, cfg.tensor_parallel_size):
            # SIGKILL: a rank left behind would hold its GPU; rank 0 stops them cleanly otherwise.
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.worker", *_rank_args(cfg, rank)],
                stdin=subprocess.DEVNULL, preexec_fn=lambda: die_with_parent(signal.SIGKILL)))
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}-watch",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        # Ranks exit 0 only when rank 0 told them to stop.
        if rc != 0 and not self.stopping.is_set():
            log.error("tensor-parallel rank %d exited with code %d: the worker stops", rank, rc)
            logging.shutdown()
            os._exit(1)  # rank 0 may be blocked in a collective with the dead rank

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks (told to stop, or not), then kill the rest."""
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_ranks(cfg: WorkerConfig) -> tuple[WorkerConfig, RankProcesses]:
    """Rank 0: validate, pick the rendezvous address, start the other ranks."""
    preflight(cfg)
    cfg = dataclasses.replace(cfg, tp_init_method=f"tcp://127.0.0.1:{free_port()}")
    return cfg, RankProcesses(cfg)


def follower_main(cfg: WorkerConfig, load_runner: Callable[[WorkerConfig, TpLink], Runner]) -> int:
    """Ranks > 0: load the shard (`load_runner`: load.load_model_runner, passed in by main.py),
    then run every request rank 0 fans out until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 decides
    link = TpLink(cfg)
    engine = Engine(cfg, None, lambda: load_runner(cfg, link), link)
    try:
        engine.load()
        while (payload := link.recv()) is not None:
            if payload:
                engine.handle(payload)
    except LoadFailed as exc:
        log.error("cannot serve %s: %s", cfg.model, exc)
        return 1
    except Exception:  # noqa: BLE001 - logged; rank 0's watcher takes the worker down
        log.exception("tensor-parallel rank %d failed", cfg.tp_rank)
        return 1
    if not link.close():
        logging.shutdown()
        os._exit(0)  # a stuck teardown thread must not keep the rank (and its GPU) alive
    return 0
