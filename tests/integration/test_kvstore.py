"""The kvstore as a real process, driven by the real client over its data planes: zero copy (the
store's block memory mapped here), the shared-memory window (the Redis backend) and gRPC bytes;
refusals, corruption found by a reader, a wrong checksum at Commit (served to no one, dropped by
the store's verifier; refused at Commit with --verify-on-commit sync), leases that end, kill -9
mid-traffic (misses, no hang, one log line; used again once restarted, the new arena mapped), the
disk tier across a kill -9, and internal mTLS (a client without the mesh's certificate is
refused)."""
from __future__ import annotations

import logging
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from services.common.devca import write_dev_ca
from services.common.internal_tls import InternalTls
from services.common.kv_blocks import checksum, kv_pb2
from services.common.kv_client import KvClient
from services.common.kv_saver import KvSaver
from services.common.ports import free_port
from tests.integration.meshproc import ROOT

import services  # noqa: F401,E402
from meshllm.v1 import kv_pb2_grpc  # noqa: E402

BLOCK = 256 << 10
NS = kv_pb2.KvNamespace(model_id="smollm2", weights_fingerprint="w", dtype="float32", kv_cache_dtype="float32",
                        block_size=16, num_layers=30, tp_size=1, block_bytes=BLOCK, layout="L2BHD")


class KvStoreProc:
    def __init__(self, *args: str, port: int = 0, env: dict[str, str] | None = None) -> None:
        self.args, self.port, self.env = list(args), port or free_port(), env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "KvStoreProc":
        # No preexec_fn: this may run while client threads hold locks, and Python code between fork
        # and exec can deadlock on them; the kvstore watches MESHLLM_PARENT_PID instead.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHLLM_PARENT_PID": str(os.getpid()), **self.env}
        self.proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(self.port),
                                      "--shm-window-mb", "8", "--shm-windows", "4", *self.args],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if re.search(r"kvstore listening on ", line):
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain
                return self
        raise RuntimeError(f"kvstore did not start (exit {self.proc.poll()})")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def kvstore():
    p = KvStoreProc("--capacity-gb", "0.25").start()
    yield p
    p.stop()


def _blocks(n: int, tag: bytes) -> list[tuple[bytes, bytes]]:
    return [(tag + i.to_bytes(4, "little"), os.urandom(BLOCK)) for i in range(n)]


def test_round_trip_over_zero_copy_and_grpc_bytes(kvstore):
    shm, plain = KvClient(kvstore.addr, chunk_bytes=8 << 20), KvClient(kvstore.addr, use_shm=False)
    try:
        assert shm.transport == "arena" and plain.transport == "grpc"
        # 40 blocks = 10 MiB: more than one 8 MiB chunk, so the client splits the batch.
        a, b = _blocks(40, b"shm-"), _blocks(6, b"grpc-")
        assert shm.put(NS, a) == 40 and plain.put(NS, b) == 6
        assert shm.lookup(NS, [h for h, _ in a] + [b"absent"]) == 40
        assert plain.lookup(NS, [h for h, _ in b]) == 6
        # Either plane reads what the other wrote, into caller buffers (as a worker loads a block).
        dests = [bytearray(BLOCK) for _ in range(42)]
        got = plain.get_into(NS, [h for h, _ in a] + [b"absent", b[0][0]], dests)
        assert got == [True] * 40 + [False, True]
        assert all(bytes(d) == data for d, (_, data) in zip(dests, a)) and bytes(dests[41]) == b[0][1]
        assert shm.get(NS, [h for h, _ in b]) == [data for _, data in b]
        stats = shm.stats()
        assert stats.backend == "memory" and stats.blocks >= 46 and stats.arena_leases >= 1
        assert stats.pinned_blocks == 0 and stats.reserved_bytes == 0 and stats.transfers == 0
    finally:
        shm.close()
        plain.close()


def test_zero_copy_reads_and_writes_in_place_are_byte_identical_and_chunked(kvstore):
    client = KvClient(kvstore.addr, chunk_bytes=4 * BLOCK)
    mapped, unmapped = [], []
    client.set_arena_hooks(mapped.append, unmapped.append)
    blocks = _blocks(10, b"zc-")
    hashes = [h for h, _ in blocks]
    fills = []

    def fill(start, idx, views):
        fills.append((start, list(idx)))
        for k, v in zip(idx, views):
            assert not v.readonly and len(v) == BLOCK
            v[:] = blocks[k][1]

    try:
        assert client.write_zero_copy(NS, hashes, fill) == 10
        assert fills == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9])]
        assert len(mapped) == 1 and unmapped == []        # mapped once, before any view was handed out
        # Stored already: EXISTS, no slot, fill not called.
        assert client.write_zero_copy(NS, hashes[:4] + [b"zc-new"], fill) == 5 and fills[-1] == (4, [4])
        seen, starts = {}, []

        def consume(start, views):
            starts.append(start)
            for i, v in enumerate(views):
                assert v is None or v.readonly
                seen[start + i] = bytes(v) if v is not None else None

        got = client.read_zero_copy(NS, hashes[:5] + [b"zc-absent"] + hashes[5:], consume)
        assert got == [True] * 5 + [False] + [True] * 5 and starts == [0, 4, 8]
        # consume returning False ends the load after its chunk: the rest is never pinned.
        assert client.read_zero_copy(NS, hashes, lambda start, views: starts.append(start) or False) == \
            [True] * 4 + [False] * 6 and starts[3:] == [0]
        assert [seen[i] for i in range(11) if i != 5] == [d for _, d in blocks] and seen[5] is None
        # put / get_into go through the same slots; a plain client reads what they wrote.
        assert KvClient(kvstore.addr, use_shm=False).get(NS, hashes[:2]) == [d for _, d in blocks[:2]]
        stats = client.stats()
        assert stats.pinned_blocks == 0 and stats.reserved_bytes == 0 and stats.transfers == 0
    finally:
        client.close()
    assert unmapped and unmapped[0] is mapped[0]              # close() unmaps it, hook first
    # No arena here (gRPC bytes only): None, the caller falls back to get_into / put.
    plain = KvClient(kvstore.addr, use_shm=False)
    try:
        assert plain.read_zero_copy(NS, hashes, consume) is None
        assert plain.write_zero_copy(NS, hashes, fill) is None
    finally:
        plain.close()


def test_a_consume_or_fill_that_raises_is_a_miss_and_a_drop_never_an_error(kvstore):
    client = KvClient(kvstore.addr)
    blocks = _blocks(3, b"raise-")
    hashes = [h for h, _ in blocks]

    def bad(*_):
        raise RuntimeError("the device copy failed")

    try:
        assert client.write_zero_copy(NS, hashes, bad) == 0 and client.lookup(NS, hashes) == 0
        assert client.put(NS, blocks) == 3
        assert client.read_zero_copy(NS, hashes, bad) == [False] * 3
        assert client.get(NS, hashes) == [d for _, d in blocks]   # nothing was dropped for it
        stats = client.stats()
        assert stats.pinned_blocks == 0 and stats.reserved_bytes == 0 and stats.transfers == 0
    finally:
        client.close()


def _map_arena(opened: "kv_pb2.OpenArenaResponse") -> mmap.mmap:
    fd = os.open(opened.path, os.O_RDWR)
    try:
        return mmap.mmap(fd, opened.arena_bytes)
    finally:
        os.close(fd)


def corrupt_in_arena(addr: str, ns, block_hash: bytes) -> None:
    """Flip a byte of a stored block where it lies in the store's memory, as a same-host process
    with the arena mapped could (pinned while it writes, released after)."""
    with grpc.insecure_channel(addr) as ch:
        stub = kv_pb2_grpc.KvStoreStub(ch)
        opened = stub.OpenArena(kv_pb2.OpenArenaRequest(zero_copy=True), timeout=5)
        lease = kv_pb2.ShmWindow(lease_id=opened.lease_id)
        pin = stub.Pin(kv_pb2.PinRequest(namespace=ns, block_hashes=[block_hash], lease=lease), timeout=5)
        mm = _map_arena(opened)
        mm[pin.blocks[0].offset + 100] ^= 0xFF
        mm.close()
        stub.Release(kv_pb2.ReleaseRequest(lease=lease, read_id=pin.read_id), timeout=5)
        stub.CloseArena(kv_pb2.CloseArenaRequest(window=lease), timeout=5)


def test_a_block_corrupted_in_place_is_found_by_the_reader_reported_and_removed(kvstore):
    client = KvClient(kvstore.addr)
    blocks = _blocks(3, b"rot-")
    hashes = [h for h, _ in blocks]
    try:
        assert client.put(NS, blocks) == 3
        before = client.stats().corrupt_blocks
        corrupt_in_arena(kvstore.addr, NS, hashes[1])   # another same-host process scribbles over block 1
        seen = {}
        got = client.read_zero_copy(NS, hashes, lambda start, views: seen.update(
            {start + i: v is not None for i, v in enumerate(views)}))
        assert got == [True, False, True] and seen == {0: True, 1: True, 2: True}   # handed out, then refused
        stats = client.stats()
        assert stats.corrupt_blocks == before + 1 and stats.pinned_blocks == 0
        assert client.lookup(NS, hashes) == 1 and client.get(NS, hashes[2:]) == [blocks[2][1]]
        assert client.put(NS, blocks[1:2]) == 1 and client.get(NS, hashes[1:2]) == [blocks[1][1]]   # saved again
    finally:
        client.close()


def commit_with_wrong_crc(addr: str, ns, hashes: list[bytes], data: bytes) -> list[int]:
    """Reserve slots for `hashes`, write `data` into each where it lies in the store's memory and
    Commit with the right CRC-32C for all but the first (a writer whose checksum is wrong, or
    whose copy went wrong); the Commit's statuses."""
    with grpc.insecure_channel(addr) as ch:
        stub = kv_pb2_grpc.KvStoreStub(ch)
        opened = stub.OpenArena(kv_pb2.OpenArenaRequest(zero_copy=True), timeout=5)
        lease = kv_pb2.ShmWindow(lease_id=opened.lease_id)
        res = stub.Reserve(kv_pb2.ReserveRequest(namespace=ns, block_hashes=hashes, lease=lease), timeout=5)
        assert [s.status for s in res.slots] == [kv_pb2.KV_PUT_STATUS_RESERVED] * len(hashes)
        mm = _map_arena(opened)
        for slot in res.slots:
            mm[slot.offset:slot.offset + len(data)] = data
        mm.close()
        crcs = [checksum(data) ^ 0x10] + [checksum(data)] * (len(hashes) - 1)
        done = stub.Commit(kv_pb2.CommitRequest(lease=lease, reserve_id=res.reserve_id, checksums=crcs), timeout=5)
        stub.CloseArena(kv_pb2.CloseArenaRequest(window=lease), timeout=5)
        return list(done.statuses)


def wait_for_miss(client: KvClient, ns, block_hash: bytes, timeout_s: float = 10.0) -> None:
    """The store's verifier drops a block committed with a wrong checksum soon after its Commit."""
    deadline = time.monotonic() + timeout_s
    while client.lookup(ns, [block_hash]):
        assert time.monotonic() < deadline, "a block committed with a wrong checksum was never dropped"
        time.sleep(0.02)


def test_a_wrong_crc_at_commit_is_never_served_and_is_dropped_and_counted(kvstore):
    data = os.urandom(BLOCK)
    client, plain = KvClient(kvstore.addr), KvClient(kvstore.addr, use_shm=False)
    try:
        before = client.stats().corrupt_blocks
        # Commit answers before the store's check (--verify-on-commit async): both are stored ...
        assert commit_with_wrong_crc(kvstore.addr, NS, [b"crc-1", b"crc-2"], data) == [
            kv_pb2.KV_PUT_STATUS_STORED] * 2
        # ... but the bad one is served to no one: the store checks a Get's bytes, a zero-copy
        # reader checks what it is handed (and reports it), and the verifier drops it.
        assert plain.get(NS, [b"crc-1", b"crc-2"]) == [None, data]                      # gRPC bytes
        assert client.read_zero_copy(NS, [b"crc-1"], lambda start, views: None) == [False]
        assert client.get(NS, [b"crc-1"]) == [None]                                      # pinned, copied out
        wait_for_miss(client, NS, b"crc-1")
        stats = client.stats()
        assert stats.corrupt_blocks == before + 1 and stats.reserved_bytes == 0 and stats.pinned_blocks == 0
        assert client.lookup(NS, [b"crc-2"]) == 1
    finally:
        client.close()
        plain.close()


def test_with_verify_on_commit_sync_a_wrong_crc_is_refused_at_commit():
    store = KvStoreProc("--capacity-gb", "0.05", "--verify-on-commit", "sync").start()
    client = KvClient(store.addr)
    data = os.urandom(BLOCK)
    try:
        assert commit_with_wrong_crc(store.addr, NS, [b"sync-1", b"sync-2"], data) == [
            kv_pb2.KV_PUT_STATUS_BAD_CHECKSUM, kv_pb2.KV_PUT_STATUS_STORED]
        assert client.lookup(NS, [b"sync-1"]) == 0 and client.lookup(NS, [b"sync-2"]) == 1
        stats = client.stats()
        assert stats.reserved_bytes == 0 and stats.corrupt_blocks == 0   # refused: never stored
    finally:
        client.close()
        store.stop()


def test_the_pins_and_slots_of_a_client_that_vanished_are_freed_when_its_lease_ends():
    store = KvStoreProc("--capacity-gb", str(4 * BLOCK / (1 << 30)), "--lease-ttl-s", "1.5").start()
    client = KvClient(store.addr)
    mapped = []
    client.set_arena_hooks(mapped.append, None)
    blocks = _blocks(2, b"ttl-")
    try:
        assert client.put(NS, blocks) == 2
        with grpc.insecure_channel(store.addr) as ch:     # a client killed mid-transfer: no Release, no Commit
            stub = kv_pb2_grpc.KvStoreStub(ch)
            lease = kv_pb2.ShmWindow(lease_id=stub.OpenArena(kv_pb2.OpenArenaRequest(zero_copy=True),
                                                             timeout=5).lease_id)
            stub.Pin(kv_pb2.PinRequest(namespace=NS, block_hashes=[h for h, _ in blocks], lease=lease), timeout=5)
            res = stub.Reserve(kv_pb2.ReserveRequest(namespace=NS, block_hashes=[b"ttl-a", b"ttl-b"], lease=lease),
                               timeout=5)
            assert [s.status for s in res.slots] == [kv_pb2.KV_PUT_STATUS_RESERVED] * 2
            stats = stub.Stats(kv_pb2.StatsRequest(), timeout=5)
            assert stats.pinned_blocks == 2 and stats.reserved_bytes == 2 * BLOCK
            # The memory is all pinned or reserved: a save finds no room (dropped, never an error).
            assert client.put(NS, _blocks(1, b"ttl-full-")) == 0
            deadline = time.monotonic() + 5
            while (s := stub.Stats(kv_pb2.StatsRequest(), timeout=5)).pinned_blocks or s.reserved_bytes:
                assert time.monotonic() < deadline, "the vanished client's pins and slots were never freed"
                time.sleep(0.1)
            assert s.transfers == 0
            with pytest.raises(grpc.RpcError) as err:     # its lease has ended
                stub.Commit(kv_pb2.CommitRequest(lease=lease, reserve_id=res.reserve_id, checksums=[0, 0]), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Idle past half its lease too, our client gets a new lease (the same mapping) and the
        # memory is usable again.
        time.sleep(0.8)
        assert client.transport == "arena" and len(mapped) == 1
        more = _blocks(4, b"ttl-more-")
        assert client.put(NS, more) == 4 and client.get(NS, [h for h, _ in more]) == [d for _, d in more]
    finally:
        client.close()
        store.stop()


def test_bad_blocks_and_bad_requests_are_refused(kvstore):
    with grpc.insecure_channel(kvstore.addr) as ch:
        stub = kv_pb2_grpc.KvStoreStub(ch)
        data = os.urandom(BLOCK)
        meta = dict(block_hash=b"bad-1", size=BLOCK)
        resp = stub.Put(kv_pb2.PutRequest(namespace=NS, blocks=[
            kv_pb2.KvBlock(meta=kv_pb2.KvBlockMeta(**meta, checksum=checksum(data) ^ 1), data=data),
            kv_pb2.KvBlock(meta=kv_pb2.KvBlockMeta(block_hash=b"bad-2", size=BLOCK - 1, checksum=checksum(data[1:])),
                           data=data[1:]),
            kv_pb2.KvBlock(meta=kv_pb2.KvBlockMeta(block_hash=b"bad-3", size=BLOCK, checksum=checksum(data[1:])),
                           data=data[1:])]), timeout=5)
        assert list(resp.statuses) == [kv_pb2.KV_PUT_STATUS_BAD_CHECKSUM, kv_pb2.KV_PUT_STATUS_BAD_SIZE,
                                       kv_pb2.KV_PUT_STATUS_BAD_SIZE]
        assert stub.Lookup(kv_pb2.LookupRequest(namespace=NS, block_hashes=[b"bad-1"]), timeout=5).num_found == 0
        for bad, text in ((kv_pb2.LookupRequest(namespace=kv_pb2.KvNamespace(model_id="m")), "block_size"),
                          (kv_pb2.LookupRequest(namespace=NS, block_hashes=[b""]), "block hash"),
                          (kv_pb2.LookupRequest(namespace=NS, block_hashes=[b"x" * 65]), "block hash")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(bad, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(kv_pb2.GetRequest(namespace=NS, block_hashes=[b"x"], window=kv_pb2.ShmWindow(lease_id=12345)),
                     timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            stub.Flush(kv_pb2.FlushRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_refused_call_is_a_miss_logged_once_and_the_store_stays_available(kvstore, caplog):
    caplog.set_level(logging.INFO, logger="meshllm.kv_client")
    bad = kv_pb2.KvNamespace(model_id="m", block_size=16, num_layers=1, tp_size=2, tp_rank=2, block_bytes=4096)
    client = KvClient(kvstore.addr)
    try:
        for _ in range(5):
            assert client.put(bad, [(b"r-1", bytes(4096))]) == 0
            assert client.lookup(bad, [b"r-1"]) == 0 and client.get(bad, [b"r-1"]) == [None]
        assert client.available and client.put(NS, [(b"r-2", bytes(BLOCK))]) == 1
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == 1 and "tp_rank" in refused[0], refused
    finally:
        client.close()


def test_background_saves_are_bounded_and_never_block_the_caller(kvstore):
    client = KvClient(kvstore.addr)
    saver = KvSaver(client, max_pending_bytes=4 * BLOCK)
    try:
        batches = [_blocks(2, b"bg-%d-" % i) for i in range(12)]
        t0 = time.monotonic()
        accepted = [saver.submit(NS, b) for b in batches]
        assert time.monotonic() - t0 < 0.1              # submitting never waits for the store
        assert saver.flush(10) and saver.pending_bytes == 0
        assert saver.saved + saver.dropped == 24 and saver.saved == 2 * sum(accepted) and saver.saved >= 2
        for ok, b in zip(accepted, batches):            # exactly the accepted batches are stored
            assert client.lookup(NS, [h for h, _ in b]) == (2 if ok else 0)
    finally:
        saver.close()
        client.close()
    # With no kvstore at all: still never blocks; everything is dropped.
    lost = KvClient(f"127.0.0.1:{free_port()}", timeout_s=0.2)
    saver = KvSaver(lost, max_pending_bytes=64 * BLOCK)
    try:
        t0 = time.monotonic()
        assert all(saver.submit(NS, _blocks(2, b"gone-%d-" % i)) for i in range(5))
        assert time.monotonic() - t0 < 0.1
        assert saver.flush(5) and saver.saved == 0 and saver.dropped == 10
    finally:
        saver.close()
        lost.close()


def test_kill_9_mid_traffic_gives_misses_without_hanging_and_the_restarted_store_is_used(caplog):
    store = KvStoreProc("--capacity-gb", "0.1").start()
    client = KvClient(store.addr, timeout_s=0.5, max_retry_after_s=1.0)
    mapped, unmapped = [], []
    client.set_arena_hooks(mapped.append, unmapped.append)
    stop, slowest, errors = threading.Event(), [0.0], []
    blocks = _blocks(4, b"k9-")

    def traffic(kind: str) -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                if kind == "save":
                    client.put(NS, blocks)
                elif kind == "zero-copy":
                    client.read_zero_copy(NS, [h for h, _ in blocks], lambda start, views: [
                        bytes(v) for v in views if v is not None])
                    client.write_zero_copy(NS, [b"k9-w"], lambda start, idx, views: [
                        v.__setitem__(slice(None), blocks[0][1]) for v in views])
                else:
                    client.get_into(NS, [h for h, _ in blocks], [bytearray(BLOCK) for _ in blocks])
                    client.lookup(NS, [h for h, _ in blocks])
            except Exception as exc:  # the contract: nothing raises into the caller
                errors.append(exc)
            slowest[0] = max(slowest[0], time.monotonic() - t)

    caplog.set_level(logging.INFO, logger="meshllm.kv_client")
    try:
        assert client.put(NS, blocks) == 4 and client.transport == "arena"
        threads = [threading.Thread(target=traffic, args=(k,)) for k in ("save", "load", "zero-copy")]
        for t in threads:
            t.start()
        time.sleep(0.5)
        store.kill9()
        time.sleep(1.5)
        # Lost: misses at once, nothing raised, no call stuck past its deadline.
        t0 = time.monotonic()
        assert client.get(NS, [blocks[0][0]]) == [None] and client.lookup(NS, [blocks[0][0]]) == 0
        assert client.put(NS, blocks[:1]) == 0 and time.monotonic() - t0 < 1.0
        assert not client.available
        store.start()                                   # the same port: the supervisor's restart
        deadline = time.monotonic() + 15
        while client.put(NS, blocks) != 4:
            assert time.monotonic() < deadline, "the restarted kvstore was not used again"
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "a client call hung"
        assert errors == []
        assert slowest[0] < 3.0, f"a call took {slowest[0]:.1f}s"
        assert client.available and client.get(NS, [blocks[1][0]]) == [blocks[1][1]]
        assert client.transport == "arena"              # the new store's arena mapped ...
        assert len(mapped) == 2 and unmapped == mapped[:1]   # ... and the old one unmapped
        # Logged once per loss, not per call: "lost" and "answers again" alternate. (On a loaded
        # machine a call to the restarted store can miss its 0.5 s deadline: a second loss.)
        episodes = [r.getMessage() for r in caplog.records if " lost (" in r.getMessage()
                    or "answers again" in r.getMessage()]
        assert episodes and " lost (" in episodes[0] and "answers again" in episodes[-1], episodes
        assert all((" lost (" in e) == (i % 2 == 0) for i, e in enumerate(episodes)), episodes
        assert len(episodes) <= 4, episodes
    finally:
        stop.set()
        client.close()
        store.stop()


def test_a_hung_kvstore_costs_one_deadline_then_misses_at_once_and_a_full_one_drops_saves():
    store = KvStoreProc("--capacity-gb", str(2 * BLOCK / (1 << 30))).start()   # room for 2 blocks
    client = KvClient(store.addr, timeout_s=0.5, lookup_timeout_s=0.2, max_retry_after_s=1.0)
    blocks = _blocks(3, b"slow-")
    try:
        assert client.put(NS, blocks) == 2                 # one put larger than the store: its tail dropped
        assert client.lookup(NS, [h for h, _ in blocks]) == 2   # the chain's head stayed
        assert client.put(NS, _blocks(1, b"slow-next-")) == 1  # full: the LRU makes room ...
        assert client.lookup(NS, [h for h, _ in blocks]) == 1  # ... from the chain's tail
        big = kv_pb2.KvNamespace(model_id="big", block_size=16, num_layers=1, tp_size=1, block_bytes=4 * BLOCK)
        assert client.put(big, [(b"big-1", bytes(4 * BLOCK))]) == 0   # larger than the store: dropped
        assert client.available
        store.proc.send_signal(signal.SIGSTOP)             # alive but silent: a hung store
        t0 = time.monotonic()
        assert client.lookup(NS, [blocks[0][0]]) == 0
        assert time.monotonic() - t0 < 1.0 and not client.available
        t0 = time.monotonic()
        for _ in range(20):                                # lost: no more deadlines paid
            assert client.get(NS, [blocks[0][0]]) == [None] and client.put(NS, blocks[:1]) == 0
        assert time.monotonic() - t0 < 0.5
        store.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while client.lookup(NS, [blocks[0][0]]) != 1:
            assert time.monotonic() < deadline, "the resumed kvstore was not used again"
            time.sleep(0.1)
        assert client.available
    finally:
        store.proc.send_signal(signal.SIGCONT)
        client.close()
        store.stop()


def test_disk_spill_survives_a_kill_9(tmp_path):
    spill = str(tmp_path / "spill")
    args = ("--capacity-gb", str(4 * BLOCK / (1 << 30)), "--disk-dir", spill, "--disk-gb", "0.05")
    store = KvStoreProc(*args).start()
    client = KvClient(store.addr, chunk_bytes=4 * BLOCK)   # a read pins one chunk at a time: the memory's size
    try:
        blocks = _blocks(12, b"disk-")
        for i in range(0, 12, 4):                      # each put evicts the one before to disk
            assert client.put(NS, blocks[i:i + 4]) == 4
        st = client.stats()
        assert st.backend == "memory+disk" and st.blocks == 4 and st.disk_blocks == 8
        store.kill9()
        store.start()
        # The first 8 blocks were spilled: found again; the last 4 were in host memory and died
        # with the process.
        hashes = [h for h, _ in blocks]
        deadline = time.monotonic() + 10
        while client.lookup(NS, hashes) != 8:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert client.lookup(NS, hashes[8:]) == 0
        got = {}
        assert client.read_zero_copy(NS, hashes[:8], lambda start, views: got.update(
            {start + i: bytes(v) for i, v in enumerate(views)})) == [True] * 8   # read through into the arena
        assert [got[i] for i in range(8)] == [d for _, d in blocks[:8]]
    finally:
        client.close()
        store.stop()


def test_the_kvstore_process_over_a_redis_backend_keeps_nothing_itself(tmp_path):
    from tests.unit.test_kvstore_store import _free_port, _redis_server
    port = _free_port()
    redis_proc = subprocess.Popen([_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(tmp_path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = KvStoreProc("--backend", f"redis://127.0.0.1:{port}/0")
    client = None
    try:
        deadline = time.monotonic() + 10
        while True:   # redis-server takes a moment to listen
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and redis_proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        store.start()
        client = KvClient(store.addr)
        # Redis keeps the blocks: no zero copy, the same-host plane is a window (8 MiB here);
        # 40 blocks = 10 MiB: more than one window, so the client splits the batch.
        assert client.transport == "shm"
        assert client.read_zero_copy(NS, [b"x"], lambda *_: None) is None
        blocks = _blocks(40, b"redis-")
        assert client.put(NS, blocks) == 40
        assert client.get(NS, [h for h, _ in blocks]) == [d for _, d in blocks]
        st = client.stats()
        assert st.backend == "redis" and st.blocks == 40 and st.arena_windows == 1
        store.kill9()              # the blocks live in Redis: a new kvstore finds them
        store.start()
        deadline = time.monotonic() + 10
        while client.lookup(NS, [h for h, _ in blocks]) != 40:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        if client is not None:
            client.close()
        store.stop()
        redis_proc.kill()
        redis_proc.wait()


def test_internal_mtls_refuses_a_client_without_the_mesh_certificate(tmp_path):
    certs = str(tmp_path / "certs")
    write_dev_ca(certs, services=("kvstore",))
    env = {"MESHLLM_INTERNAL_TLS_CERTFILE": f"{certs}/kvstore.pem", "MESHLLM_INTERNAL_TLS_KEYFILE": f"{certs}/kvstore.key",
           "MESHLLM_INTERNAL_TLS_CA_CERTS": f"{certs}/ca.pem"}
    store = KvStoreProc("--capacity-gb", "0.05", env=env).start()
    mesh = InternalTls(f"{certs}/client.pem", f"{certs}/client.key", f"{certs}/ca.pem")
    data = os.urandom(BLOCK)
    put = kv_pb2.PutRequest(namespace=NS, blocks=[kv_pb2.KvBlock(
        meta=kv_pb2.KvBlockMeta(block_hash=b"tls-1", size=BLOCK, checksum=checksum(data)), data=data)])
    try:
        for creds in (None, grpc.ssl_channel_credentials(open(f"{certs}/ca.pem", "rb").read())):
            ch = grpc.secure_channel(store.addr, creds) if creds else grpc.insecure_channel(store.addr)
            with ch:
                with pytest.raises(grpc.RpcError) as err:
                    kv_pb2_grpc.KvStoreStub(ch).Put(put, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        outsider = KvClient(store.addr, timeout_s=0.5)
        assert outsider.put(NS, [(b"tls-2", data)]) == 0      # refused, and never raised
        outsider.close()
        member = KvClient(store.addr, credentials=mesh.channel_credentials())
        assert member.put(NS, [(b"tls-3", data)]) == 1 and member.get(NS, [b"tls-3"]) == [data]
        assert member.lookup(NS, [b"tls-1", b"tls-2"]) == 0
        member.close()
    finally:
        store.stop()
