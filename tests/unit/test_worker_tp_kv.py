"""Tensor-parallel workers with the KV tiers and the direct hand-off (docs/kv_tiers.md, docs/pd.md):
real `python -m services.worker --tensor-parallel-size 2` processes (rank 0 and the rank it
starts, gloo on the CPU) and a real kvstore, driven over the workers' ZMQ sockets by the real
scheduler core through both wire edges, as in the mesh. Each rank saves and loads its own shard
under its own namespace, and a block counts as loaded only if every rank loaded its shard
(services/worker/tier_agreement.py, whose core is also tested here on its own)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from services.common import pb
from services.common.kv_client import KvClient
from services.common.procs import die_with_parent
from services.scheduler import wire as sched_wire
from services.scheduler.core import Request, Scheduler, SchedulerConfig
from services.worker.plan import LoadResult, SaveResult
from services.worker.tier_agreement import NOT_ENDED, RankAgreement
from tests.integration.meshproc import ROOT
from tests.integration.test_kvstore import KvStoreProc
from tests.unit.tiny_llama import VOCAB, make_tiny_llama

BS = 4


# ---- the agreement's core, two ranks in one process ---------------------------------------------

class _Rank:
    def __init__(self) -> None:
        self.loads: list[LoadResult] = []
        self.saves: list[SaveResult] = []
        self.agreement = RankAgreement(self._take)

    def _take(self):
        out = self.loads, self.saves
        self.loads, self.saves = [], []
        return out


def _round(ranks: list[_Rank]) -> None:
    """One fan-out: rank 0 proposes, every rank answers, MIN over the answers."""
    loads, saves = ranks[0].agreement.propose()
    if not loads and not saves:
        return
    answers = [r.agreement.local_counts(loads, saves) for r in ranks]
    mins = [min(col) for col in zip(*answers)]
    for r in ranks:
        r.agreement.settle(loads, saves, mins)


def test_a_load_is_reported_once_every_rank_ended_it_with_the_fewest_blocks():
    ranks = [_Rank(), _Rank()]
    ranks[0].loads.append(LoadResult("a", 15, 15, 15 * 100, 5))
    _round(ranks)
    assert ranks[0].agreement.pending and not ranks[0].agreement.take_loads()   # rank 1 still fetching
    assert ranks[1].agreement.local_counts([LoadResult("a", 15, 15)], []) == [NOT_ENDED]
    ranks[1].loads.append(LoadResult("a", 5, 15, 5 * 100, 9))                    # its shard of block 5 missing
    _round(ranks)
    assert ranks[0].agreement.take_loads() == [LoadResult("a", 5, 15, 5 * 100, 5)]
    assert ranks[1].agreement.take_loads() == [LoadResult("a", 5, 15, 5 * 100, 5)]
    assert not ranks[0].agreement.pending and not ranks[1].agreement.pending


def test_saves_of_one_request_are_agreed_batch_by_batch_and_a_dropped_shard_counts_as_dropped():
    ranks = [_Rank(), _Rank()]
    ranks[0].saves += [SaveResult("p", 4, 4), SaveResult("p", 3, 3)]
    ranks[1].saves += [SaveResult("p", 4, 4)]
    _round(ranks)
    assert ranks[0].agreement.take_saves() == [SaveResult("p", 4, 4)]
    ranks[1].saves += [SaveResult("p", 3, 0)]                                     # rank 1 dropped its batch
    _round(ranks)
    assert ranks[0].agreement.take_saves() == [SaveResult("p", 3, 0)]
    assert not ranks[0].agreement.pending and not ranks[1].agreement.pending


def test_a_new_scheduler_forgets_the_loads_but_not_the_saves_in_flight():
    ranks = [_Rank(), _Rank()]
    ranks[0].loads.append(LoadResult("old", 2, 2))
    ranks[0].saves.append(SaveResult("s", 2, 2))
    _round(ranks)
    for r in ranks:
        r.agreement.forget_loads()
    ranks[1].saves.append(SaveResult("s", 2, 2))
    _round(ranks)
    assert ranks[0].agreement.take_loads() == [] and ranks[0].agreement.take_saves() == [SaveResult("s", 2, 2)]
    with pytest.raises(ValueError):
        ranks[0].agreement.settle([LoadResult("x", 1, 1)], [], [])


# ---- two tensor-parallel workers and a kvstore --------------------------------------------------

class TpWorker:
    """One worker process with --tensor-parallel-size 2 (it starts its rank 1), spoken to as the
    scheduler speaks to it: WorkerRequest bytes over a DEALER socket."""

    def __init__(self, model_dir, tmp_path, name: str, *flags: str) -> None:
        self.log = open(tmp_path / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "services.worker", "--model", str(model_dir),
               "--zmq-addr", f"ipc://{tmp_path}/{name}.ipc", "--num-kv-blocks", "64", "--block-size", str(BS),
               "--max-model-len", "256", "--num-threads", "1", "--tensor-parallel-size", "2", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.grpc_addr = ""

    def wait_listening(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            if line.startswith("worker listening"):
                fields = dict(f.split("=", 1) for f in line.split()[2:])
                self.grpc_addr = fields["grpc"]
                self.sock.connect(fields["zmq"])
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
            assert time.monotonic() < deadline
        raise AssertionError(f"the worker exited ({self.proc.poll()}): {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def _call(self, req: pb.step.WorkerRequest) -> pb.step.WorkerReply:
        self.sock.send(req.SerializeToString())
        assert self.sock.poll(120_000), f"no reply from the worker: {self.tail()}"
        return pb.step.WorkerReply.FromString(self.sock.recv())

    def hello(self) -> pb.step.WorkerInfo:
        return self._call(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=BS))).info

    def execute(self, req: pb.step.WorkerRequest) -> pb.step.StepResult:
        reply = self._call(req)
        assert reply.HasField("result"), reply
        return reply.result

    def stop(self) -> None:
        self.proc.terminate()   # a no-op when already told
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.sock.close()
        self.ctx.term()
        self.log.close()


class Core:
    """A fresh scheduler core on a worker (a new hello: every request, fetch and lease of the
    previous one is gone), stepped as the adapter steps it."""

    def __init__(self, worker: TpWorker, store: KvClient | None = None, export: bool = False) -> None:
        self.worker, self.store = worker, store
        info = worker.hello()
        self.ns = info.kv_namespace if store is not None and info.HasField("kv_namespace") else None
        cfg = SchedulerConfig(max_model_len=256, block_size=BS, max_num_batched_tokens=64, kv_tier=self.ns is not None)
        self.core = Scheduler(cfg, info.num_kv_blocks, frozenset(), VOCAB, num_host_blocks=info.num_host_kv_blocks,
                              export_addr=info.kv_export_addr if export else "")
        self.saved_hashes: dict[str, list[bytes]] = {}
        self.handoffs = {}

    def run(self, *requests: Request) -> tuple[dict, dict]:
        core = self.core
        for r in requests:
            assert core.add_request(r) is None
        outputs = {r.request_id: [] for r in requests}
        cached: dict[str, int] = {}
        for _ in range(3000):
            for rid, hashes in core.take_lookups():
                core.on_tier_lookup(rid, self.store.lookup(self.ns, hashes))
            if not core.has_work():
                break
            plan = core.schedule()
            if plan.is_empty() and not core.loading:
                continue
            for t in plan.tier_saves:
                self.saved_hashes.setdefault(t.request_id, []).extend(t.block_hashes)
            result = self.worker.execute(sched_wire.plan_to_proto(plan))
            assert not result.HasField("error"), result.error
            for out in core.update(plan, sched_wire.result_from_proto(result)):
                outputs[out.request_id].extend(out.new_token_ids)
                if out.new_token_ids:
                    cached.setdefault(out.request_id, out.num_cached_tokens)
                if out.handoff_blocks >= 0:
                    self.handoffs[out.request_id] = out
        assert not core.has_work()
        return outputs, cached


def long_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


def rank_ns(ns, rank: int):
    other = type(ns)()
    other.CopyFrom(ns)
    other.tp_rank = rank
    return other


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A kvstore and two TP=2 workers (A and B), each exporting its cache and using the kvstore;
    A also has a host pool (tier 1).
    B, which loads, overlaps steps as on a GPU: its rank 0 fans plan N+1 out (and the agreement
    with it) before it collects step N, while its rank 1 runs one request after the other."""
    tmp = tmp_path_factory.mktemp("tp-kv")
    model_dir = make_tiny_llama(tmp / "tiny", seed=5)
    store = KvStoreProc("--capacity-gb", "0.1").start()
    flags = ("--kvstore-addr", store.addr, "--kv-export", "--kv-load-timeout-ms", "5000")
    workers = [TpWorker(model_dir, tmp, "a", *flags, "--kv-offload-gb", "0.01"),
               TpWorker(model_dir, tmp, "b", *flags, "--overlap-steps", "on")]
    client = KvClient(store.addr)
    try:
        for w in workers:
            w.wait_listening()
        yield workers[0], workers[1], client
    finally:
        client.close()
        for w in workers:   # both stop at once
            w.proc.terminate()
        for w in workers:
            w.stop()
        store.stop()


def _wait_stored(client: KvClient, ns, hashes: list[bytes], timeout_s: float = 20.0) -> None:
    """Saves end in the workers' background after the request did: wait until both ranks' are in."""
    deadline = time.monotonic() + timeout_s
    while any(client.lookup(rank_ns(ns, r), hashes) < len(hashes) for r in range(2)):
        assert time.monotonic() < deadline, "the ranks' saves did not all arrive"
        time.sleep(0.05)


def test_tp2_prompt_saved_by_one_worker_is_loaded_by_another_with_the_cold_output(mesh):
    a, b, client = mesh
    p = long_prompt(1, 61)                                       # 15 full blocks + 1
    cold, _ = Core(a).run(Request("cold", list(p), 6))
    saver = Core(a, client)
    first, _ = saver.run(Request("a", list(p), 6))
    assert first["a"] == cold["cold"]
    hashes = saver.saved_hashes["a"]
    assert len(hashes) == 15
    _wait_stored(client, saver.ns, hashes)                       # rank 0's namespace and rank 1's
    loader = Core(b, client)
    again, cached = loader.run(Request("b", list(p), 6))
    assert again["b"] == cold["cold"]
    assert cached["b"] == 60
    assert loader.core.tier_stats["kvstore_loaded_blocks"] == 15


def test_a_block_counts_as_loaded_only_where_every_rank_loaded_its_shard(mesh):
    """Rank 1's namespace keeps only the first 5 blocks: rank 0 loads 15, rank 1 loads 5, and all
    ranks count 5 (blocks 5.. are recomputed on both, the output is the cold one)."""
    a, b, client = mesh
    p = long_prompt(2, 61)
    cold, _ = Core(a).run(Request("cold", list(p), 6))
    saver = Core(a, client)
    saver.run(Request("a", list(p), 6))
    hashes = saver.saved_hashes["a"]
    _wait_stored(client, saver.ns, hashes)
    ns1 = rank_ns(saver.ns, 1)
    keep = client.get(ns1, hashes[:5])
    assert all(keep)
    client.flush(ns1)
    assert client.put(ns1, list(zip(hashes[:5], keep))) == 5
    assert client.lookup(saver.ns, hashes) == 15 and client.lookup(ns1, hashes) == 5
    loader = Core(b, client)
    out, cached = loader.run(Request("b", list(p), 6))
    assert out["b"] == cold["cold"]
    assert cached["b"] == 5 * BS
    stats = loader.core.tier_stats
    assert stats["kvstore_loaded_blocks"] == 5 and stats["kvstore_failed_blocks"] == 10


def test_tp2_direct_hand_off_gives_the_cold_output_and_a_bad_peer_is_recomputed(mesh):
    a, b, _ = mesh
    p = long_prompt(3, 45)                                       # 11 full blocks + 1
    cold, _ = Core(a).run(Request("cold", list(p), 6))
    prefill = Core(a, export=True)
    r = Request("a", list(p), 6)
    r.prefill_only = True
    first, _ = prefill.run(r)
    assert first["a"] == cold["cold"][:1]
    h = prefill.handoffs["a"]
    assert h.handoff_peer == a.grpc_addr and h.handoff_blocks == 11

    def decode(peer: str) -> tuple[list[int], int, Core]:
        d = Core(b)
        req = Request("c", list(p), 6)
        req.append_output(first["a"][0])
        req.handoff, req.kv_tier_blocks = True, h.handoff_blocks
        req.peer, req.src_block_ids = peer, list(h.handoff_block_ids)
        req.lease_deadline_ns = time.time_ns() + 30 * 10**9
        out, cached = d.run(req)
        return first["a"] + out["c"], cached["c"], d

    tokens, cached, d = decode(h.handoff_peer)
    assert tokens == cold["cold"] and cached == 44                # rank r copied prefill rank r's shard
    assert d.core.tier_stats["kvstore_loaded_blocks"] == 11
    tokens, cached, _ = decode("127.0.0.1:1")                     # nobody there: both ranks fail, recomputed
    assert tokens == cold["cold"] and cached == 0
    prefill.core.abort(["a"])                                     # the gateway releases the lease


def test_tp2_host_offload_serves_prompts_the_device_pool_evicted(mesh):
    """Tier 1: every rank copies its own shard to and from the same slots (rank 1 needs rank 0's
    --kv-offload-gb: without a host pool it would refuse the plans rank 0 runs)."""
    a, _, _ = mesh
    prompts = {f"h{i}": long_prompt(20 + i, 61) for i in range(6)}   # 90 full blocks > the 64 on the device
    e = Core(a)
    first = {}
    for rid, p in prompts.items():
        first.update(e.run(Request(rid, list(p), 4))[0])
    again, cached = e.run(Request("h0'", list(prompts["h0"]), 4))
    assert again["h0'"] == first["h0"] and cached["h0'"] == 60      # every block back from host memory
    assert e.core.tier_stats["host_hit_blocks"] == 15


def test_a_peer_of_another_tensor_parallel_size_is_refused_and_rank_r_maps_rank_rs_shard(mesh):
    """What a decode rank sees of a TP=2 prefill worker's exports (kv_export.Peers)."""
    from services.worker.kv_export import Peers
    a, _, _ = mesh
    Core(a, export=True)   # a hello: rank 0 holds both ranks' exports
    shape = (2, 64, BS, 1, 8)                                    # one rank's: 1 of the 2 kv heads
    for tp, want in [((1, 0), "tensor-parallel size 2, this one 1"), ((4, 2), "rank 2 was asked for")]:
        peers = Peers(None, shape, torch.float32, torch.device("cpu"), tp=tp)
        with pytest.raises(Exception, match=want):
            peers.get(a.grpc_addr)
        peers.close()
    descs = []
    for rank in range(2):
        peers = Peers(None, shape, torch.float32, torch.device("cpu"), tp=(2, rank))
        peer = peers.get(a.grpc_addr)
        assert peer.num_blocks == 64
        descs.append(pb.control.KvExport.FromString(peer.key))
        peers.close()
    assert [d.tp_rank for d in descs] == [0, 1] and descs[0].pid != descs[1].pid   # each rank's own cache


def test_every_rank_gets_rank_0s_kv_tier_flags(tmp_path):
    """A rank without rank 0's tiers would refuse the plans rank 0 runs (and rank 0 would wait in
    the forward's all-reduce for it), so the tier, export and weight flags reach every rank."""
    from services.worker.config import WorkerConfig
    from services.worker.main import parse_args
    from services.worker.tp_ranks import _rank_args
    model_dir = make_tiny_llama(tmp_path / "m", seed=1)
    cfg = WorkerConfig(model=str(model_dir), zmq_addr="tcp://127.0.0.1:5", tensor_parallel_size=2,
                       tp_init_method="tcp://127.0.0.1:6", kvstore_addr="127.0.0.1:7", kv_offload_gb=0.5,
                       kv_load_timeout_ms=900.0, kv_save_buffer_mb=64.0, kv_export=True, kv_direct_transport="auto",
                       quantization="fp8")
    rank1 = parse_args(_rank_args(cfg, 1))
    assert (rank1.tp_rank, rank1.kvstore_addr, rank1.kv_offload_gb, rank1.kv_load_timeout_ms) == (1, "127.0.0.1:7", 0.5, 900.0)
    assert (rank1.kv_save_buffer_mb, rank1.kv_export, rank1.kv_direct_transport) == (64.0, True, "auto")
    assert rank1.quantization == "fp8"
    plain = parse_args(_rank_args(WorkerConfig(model=str(model_dir), zmq_addr="tcp://127.0.0.1:5", tensor_parallel_size=2,
                                               tp_init_method="tcp://127.0.0.1:6"), 1))
    assert not plain.kvstore_addr and not plain.kv_export and plain.kv_offload_gb == 0
