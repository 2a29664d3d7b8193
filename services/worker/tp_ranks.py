"""The ranks of a tensor-parallel worker (`--tensor-parallel-size N`).

Rank 0 is the worker process the launcher started: it owns the ZMQ socket and the gRPC health
server, and it starts ranks 1..N-1 as child processes (`python -m services.worker ... --tp-rank r`).
Every rank loads the model, keeps its shard (tp.py) and allocates the KV cache of its own heads,
so `--kv-cache-memory-gb` is per rank and every rank computes the same number of blocks.

Each WorkerRequest that rank 0 receives is fanned out as its serialized protobuf bytes: a
broadcast of two lengths (int64: the request's, the agreement proposal's), then of the bytes
(uint8), over a gloo group (the CPU side even when the model's all-reduces run on NCCL). Every
rank then runs the same request; only rank 0 answers the scheduler. Lengths 0 are a heartbeat
that keeps idle ranks inside the collectives' timeout; -1 tells them to stop. Nothing is pickled.

KV tiers (docs/kv_tiers.md): each rank fetches and saves its own shard on its own threads, so the
ranks agree on which of those jobs ended before any is reported (tier_agreement.py). Rank 0's
proposal (the jobs that ended on it, a StepResult holding only kv_loads / kv_saves) rides on the
request it fans out; right after the fan-out every rank answers with its own counts in one
all-reduce (MIN). It runs only when rank 0 proposes something, at the same point of the same
request on every rank, before that request runs. Direct hand-offs: every rank exports its own
cache; the ranks gather their descriptors on rank 0 at load and after every hello (the cache may
have been allocated again), and rank 0's WorkerControl.ExportKv serves them (kv_export.py).

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

from services.common.gc_heap import freeze_startup_heap
from services.common import pb
from services.common.ports import free_port
from services.common.procs import die_with_parent
from services.worker.config import WorkerConfig
from services.worker.engine import Engine, LoadFailed, Runner
from services.worker.models.config import ModelConfigError, load_model_config
from services.worker.plan import LoadResult, SaveResult
from services.worker.tp import check_tp_size, init_tp

log = logging.getLogger("meshllm.worker.tp")

HEARTBEAT_S = 10.0        # idle rank 0 pings the others this often
CLOSE_TIMEOUT_S = 3.0     # a clean stop must fit the 15 s hard-exit timer of install_stop_handlers
COLLECTIVE_TIMEOUT_S = 1800.0  # rendezvous, loading and any one collective (the heartbeat is far below)
_STOP = -1


def _encode_proposal(loads: list[LoadResult], saves: list[SaveResult]) -> bytes:
    msg = pb.step.StepResult()
    for r in loads:
        msg.kv_loads.add(request_id=r.request_id, num_loaded=r.num_loaded, num_requested=r.num_requested,
                         bytes=r.bytes, duration_ns=r.duration_ns)
    for r in saves:
        msg.kv_saves.add(request_id=r.request_id, num_blocks=r.num_blocks, num_saved=r.num_saved)
    return msg.SerializeToString()


def _decode_proposal(data: bytes) -> tuple[list[LoadResult], list[SaveResult]]:
    msg = pb.step.StepResult.FromString(data)
    return ([LoadResult(r.request_id, r.num_loaded, r.num_requested, r.bytes, r.duration_ns) for r in msg.kv_loads],
            [SaveResult(r.request_id, r.num_blocks, r.num_saved) for r in msg.kv_saves])


class TpLink:
    """This rank's place in the group and the channel every WorkerRequest travels on."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.rank, self.size, self.init_method = cfg.tp_rank, cfg.tensor_parallel_size, cfg.tp_init_method
        self.group = None          # the model's all-reduces (NCCL on CUDA, gloo on CPU)
        self.cpu_group = None      # the plan fan-out (gloo)
        self.seed_rng: random.Random | None = None
        self.runner = None         # this rank's ModelRunner once loaded (attach)
        self.exports: list[pb.control.KvExport] = []   # every rank's exported cache (share_exports)
        self._len = torch.zeros(2, dtype=torch.int64)  # [request bytes, proposal bytes]
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

    # ---- every rank: what the ranks must agree on besides the requests -------------------------
    def attach(self, runner) -> None:
        """This rank's runner, once loaded: its KV tiers' agreement rides on the fan-out, and its
        exported cache is shared with rank 0 (a collective: every rank calls it at load)."""
        self.runner = runner
        runner.tp_spec = self   # used only with --speculative-config
        self.share_exports()

    def after_hello(self) -> None:
        """Every rank, right after it handled a WorkerHello: the hello may have allocated the
        KV cache again, so the ranks share their exports again."""
        if self.runner is not None:
            self.share_exports()

    def share_exports(self) -> None:
        """Gather every rank's KvExport (b"" without an exported cache) on every rank."""
        exported = getattr(self.runner, "exported", None)
        mine = b""
        if exported is not None:
            desc = exported.describe()
            desc.tp_size, desc.tp_rank = self.size, self.rank
            mine = desc.SerializeToString()
        gathered = self._all_gather_bytes(mine)
        self.exports = [pb.control.KvExport.FromString(b) for b in gathered] if all(gathered) else []

    def export_of(self, rank: int) -> "pb.control.KvExport":
        """Rank 0's WorkerControl.ExportKv: rank `rank`'s exported cache (LookupError: none)."""
        exports = self.exports
        if not 0 <= rank < len(exports):
            raise LookupError(f"this worker has tensor-parallel size {self.size} and exports "
                              f"{len(exports)} ranks; rank {rank} was asked for")
        return exports[rank]

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, n, group=self.cpu_group)
        width = max(1, max(int(t.item()) for t in sizes))
        buf = torch.zeros(width, dtype=torch.uint8)   # gloo's all_gather wants equal sizes
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(bufs, buf, group=self.cpu_group)
        return [b[:int(t.item())].numpy().tobytes() for b, t in zip(bufs, sizes)]

    def _agreement(self):
        tiers = getattr(self.runner, "tiers", None)
        return None if tiers is None else tiers.agreement

    def _settle(self, proposal: bytes) -> None:
        """Every rank, right after the fan-out of a request that carried rank 0's proposal."""
        loads, saves = _decode_proposal(proposal)
        agreement = self._agreement()
        # Every rank must join the all-reduce; one without an agreement (it cannot happen: the
        # ranks share their flags) answers "not ended", so nothing is reported.
        counts = (agreement.local_counts(loads, saves) if agreement is not None
                  else [-1] * (len(loads) + len(saves)))
        mins = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=self.cpu_group)
        if agreement is not None:
            agreement.settle(loads, saves, mins.tolist())

    # ---- every rank: speculative decoding's choices are rank 0's ------------------------------
    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree_flag(self, flag: bool) -> bool:
        """Rank 0's flag on every rank (runner.submit: whether to read the previous step first)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.broadcast(t, 0, group=self.cpu_group)
        return bool(t.item())

    def agree_drafts(self, drafts: list[list[int]]) -> list[list[int]]:
        """Rank 0's drafts per scheduled row (the same rows in the same order on every rank: they
        come from the same plan) on every rank. Two broadcasts: the row counts, then the tokens."""
        counts = torch.tensor([len(d) for d in drafts] if self.rank == 0 else [0] * len(drafts), dtype=torch.int64)
        if counts.numel():
            dist.broadcast(counts, 0, group=self.cpu_group)
        total = int(counts.sum().item()) if counts.numel() else 0
        if not total:
            return [[] for _ in drafts]
        flat = torch.tensor([t for d in drafts for t in d] if self.rank == 0 else [0] * total, dtype=torch.int64)
        dist.broadcast(flat, 0, group=self.cpu_group)
        out, i = [], 0
        values = flat.tolist()
        for c in counts.tolist():
            out.append(values[i:i + c])
            i += c
        return out

    # ---- rank 0 ------------------------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        agreement = self._agreement()
        proposal = b""
        if agreement is not None:
            loads, saves = agreement.propose()
            if loads or saves:
                proposal = _encode_proposal(loads, saves)
        self._send_len(len(payload), len(proposal))
        if payload or proposal:
            data = payload + proposal
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.cpu_group)
        if proposal:
            self._settle(proposal)

    def heartbeat(self) -> None:
        if time.monotonic() - self._last_send >= HEARTBEAT_S:
            self._send_len(0, 0)

    def send_stop(self) -> None:
        self._send_len(_STOP, 0)

    def _send_len(self, n: int, m: int) -> None:
        self._len[0], self._len[1] = n, m
        dist.broadcast(self._len, 0, group=self.cpu_group)
        self._last_send = time.monotonic()

    # ---- ranks > 0 ---------------------------------------------------------------------------
    def recv(self) -> bytes | None:
        """The next WorkerRequest's bytes; b"" for a heartbeat; None when rank 0 stops."""
        dist.broadcast(self._len, 0, group=self.cpu_group)
        n, m = int(self._len[0].item()), int(self._len[1].item())
        if n == _STOP:
            return None
        if n + m == 0:
            return b""
        buf = torch.empty(n + m, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.cpu_group)
        data = buf.numpy().tobytes()
        if m:
            self._settle(data[n:])
        return data[:n]

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
    """Every flag that shapes what a rank computes or holds: the same weights, KV cache and KV tiers
    on every rank (a rank without rank 0's tiers would refuse the plans rank 0 runs)."""
    tls = cfg.internal_tls
    return ["--model", cfg.model, "--zmq-addr", cfg.zmq_addr, "--device", cfg.device, "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_model_len), "--kv-cache-memory-gb", str(cfg.kv_cache_memory_gb),
            "--kv-cache-dtype", cfg.kv_cache_dtype, "--quantization", cfg.quantization,
            "--num-kv-blocks", str(cfg.num_kv_blocks), "--block-size", str(cfg.block_size),
            "--served-model-name", cfg.served_model_name, "--num-threads", str(cfg.num_threads),
            *(["--enforce-eager"] if cfg.enforce_eager else []),
            "--kv-offload-gb", str(cfg.kv_offload_gb), "--kvstore-addr", cfg.kvstore_addr,
            "--kv-load-timeout-ms", str(cfg.kv_load_timeout_ms), "--kv-save-buffer-mb", str(cfg.kv_save_buffer_mb),
            *(["--kv-export"] if cfg.kv_export else []), "--kv-direct-transport", cfg.kv_direct_transport,
            # The kvstore client and the peers' WorkerControl channels use internal mTLS too.
            *(["--internal-tls-certfile", tls.certfile, "--internal-tls-keyfile", tls.keyfile,
               "--internal-tls-ca-certs", tls.ca_certs] if tls.enabled else []),
            *(["--speculative-config", cfg.speculative_config] if cfg.speculative_config else []),
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
        freeze_startup_heap(log)
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
