"""The kvstore's commit verifier (--verify-on-commit async): a zero-copy Commit stores its blocks
unverified and answers; a block whose bytes do not match its writer's checksum is returned by no
read path (Get: the store checks it; Pin: the reader checks what it is handed and reports it; the
disk tier: checked before it is written) and the verifier drops it, counts it and frees its
space; the accounting stays exact; the backlog is bounded and a shutdown abandons it cleanly.

Blocks are small (16 KiB); the store is the real memory backend (and a real disk tier)."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.common.kv_blocks import checksum
from services.kvstore import metrics, record
from services.kvstore.disk import DiskTier
from services.kvstore.memory import MemoryBackend
from services.kvstore.store import PutStatus, Store
from services.kvstore.verifier import CommitVerifier

BLOCK = 16 << 10
NSID = b"n" * 16


def _data(i: int) -> bytes:
    return i.to_bytes(4, "little") * (BLOCK // 4)


def _commit_unverified(store: Store, hashes: list[bytes], bad: set[int]) -> list:
    """Reserve, fill block i with _data(i), commit unverified with the right CRC-32C except for
    the indices in `bad`; the slots."""
    slots = store.reserve(NSID, BLOCK, hashes)
    for i, slot in enumerate(slots):
        store.backend.view(slot)[:] = _data(i)
    claimed = [checksum(_data(i)) ^ (1 if i in bad else 0) for i in range(len(hashes))]
    assert store.commit(NSID, BLOCK, hashes, slots, claimed, verify=False) == [PutStatus.STORED] * len(hashes)
    return slots


def _extra(store: Store) -> dict:
    return store.backend.stats().extra


@pytest.fixture
def pool():
    p = ThreadPoolExecutor(2)
    yield p
    p.shutdown()


def test_the_verifier_drops_a_mismatch_counts_it_and_frees_its_space(pool):
    store = Store(MemoryBackend(8 * BLOCK))
    verifier = CommitVerifier(store, pool)
    hashes = [b"good", b"bad"]
    assert verifier.admit(2 * BLOCK)
    slots = _commit_unverified(store, hashes, bad={1})
    assert _extra(store)["unverified_bytes"] == 2 * BLOCK and store.lookup(NSID, hashes) == 2
    verifier.submit(NSID, list(zip(hashes, slots)), 2 * BLOCK)
    assert verifier.drain(5.0) and verifier.backlog_bytes == 0
    assert store.lookup(NSID, hashes[:1]) == 1 and store.lookup(NSID, hashes[1:]) == 0
    s = store.backend.stats()
    assert s.extra["commit_mismatches"] == 1 and s.corrupt_blocks == 1 and s.extra["unverified_bytes"] == 0
    assert s.extra["free_bytes"] == 7 * BLOCK and s.extra["pins"] == 0 and s.bytes == BLOCK
    # The metric counts it (refreshed from the store's stats).
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(metrics.refresh_gauges(store, None, every_s=10.0), 0.5))
    assert metrics.COMMIT_MISMATCHES._value.get() == 1 and metrics.UNVERIFIED._value.get() == 0


def test_an_unverified_mismatch_is_never_returned_by_get_or_a_pin():
    store = Store(MemoryBackend(8 * BLOCK))   # no verifier: every block stays unverified until read
    _commit_unverified(store, [b"g0", b"g1"], bad={1})
    # gRPC bytes (and the window): the store checks the bytes before it answers.
    assert store.get(NSID, BLOCK, b"g0")[0] == _data(0)
    assert store.get(NSID, BLOCK, b"g1") is None and store.lookup(NSID, [b"g1"]) == 0
    assert _extra(store)["commit_mismatches"] == 1 and _extra(store)["unverified_bytes"] == 0   # g0 checked too
    # A pin hands the bytes with the writer's checksum to a reader that checks them (zero copy
    # and NIXL): the check fails, the reader reports it, the store agrees and drops it.
    _commit_unverified(store, [b"p0", b"p1"], bad={1})
    pinned = store.pin(NSID, BLOCK, [b"p0", b"p1"])
    seen = [checksum(store.backend.view(e)) == e.crc for e in pinned]
    assert seen == [True, False]
    assert store.release(NSID, [b"p0", b"p1"], pinned, [1]) == 1
    assert store.lookup(NSID, [b"p1"]) == 0 and store.lookup(NSID, [b"p0"]) == 1
    s = store.backend.stats()
    assert s.extra["commit_mismatches"] == 2 and s.extra["pins"] == 0
    assert s.extra["free_bytes"] == 8 * BLOCK - s.bytes and s.bytes == 2 * BLOCK


def test_only_verified_blocks_reach_the_disk_tier(tmp_path):
    spill_dir = str(tmp_path / "spill")
    per_file = record.record_size(b"x" * 32, BLOCK)
    store = Store(MemoryBackend(2 * BLOCK, DiskTier(spill_dir, 16 * per_file)))
    _commit_unverified(store, [b"e0", b"e1"], bad={0})
    for i in range(2):   # two more blocks evict both unverified ones to the disk tier
        store.put(NSID, BLOCK, b"x%d" % i, _data(i), checksum(_data(i)))
    assert store.lookup(NSID, [b"e1"]) == 1 and store.lookup(NSID, [b"e0"]) == 0   # e0 never written
    assert _extra(store)["commit_mismatches"] == 1
    _commit_unverified(store, [b"c0", b"c1"], bad={1})   # in memory at close: checked on the way out
    store.backend.close()
    again = Store(MemoryBackend(2 * BLOCK, DiskTier(spill_dir, 16 * per_file)))
    assert again.lookup(NSID, [b"c0"]) == 1 and again.lookup(NSID, [b"c1"]) == 0
    assert again.get(NSID, BLOCK, b"c0")[0] == _data(0) and again.get(NSID, BLOCK, b"e1")[0] == _data(1)
    again.backend.close()


def test_a_block_removed_before_its_check_is_skipped_and_the_accounting_stays_exact(pool):
    store = Store(MemoryBackend(4 * BLOCK))
    verifier = CommitVerifier(store, pool)
    hashes = [b"f0", b"f1", b"f2"]
    assert verifier.admit(3 * BLOCK)
    slots = _commit_unverified(store, hashes, bad={0, 2})
    pinned = store.pin(NSID, BLOCK, hashes[:1])           # a reader holds f0 while it is flushed
    assert store.flush(NSID) == 3
    verifier.submit(NSID, list(zip(hashes, slots)), 3 * BLOCK)
    assert verifier.drain(5.0)
    s = store.backend.stats()
    assert s.extra["commit_mismatches"] == 0 and s.extra["unverified_bytes"] == 0 and s.bytes == 0
    assert s.extra["free_bytes"] == 3 * BLOCK              # f0's extent is the reader's until released
    store.release(NSID, hashes[:1], pinned, [])
    assert _extra(store)["free_bytes"] == 4 * BLOCK


def test_the_backlog_is_bounded_and_a_shutdown_abandons_it_without_hanging():
    store = Store(MemoryBackend(8 * BLOCK))
    one = ThreadPoolExecutor(1)
    verifier = CommitVerifier(store, one, max_backlog_bytes=2 * BLOCK)
    assert verifier.admit(2 * BLOCK) and not verifier.admit(BLOCK)   # full: that Commit checks first
    gate = threading.Event()
    one.submit(gate.wait)                                 # the check threads are busy
    hashes = [b"s0", b"s1"]
    slots = _commit_unverified(store, hashes, bad={1})
    verifier.submit(NSID, list(zip(hashes, slots)), 2 * BLOCK)
    assert not verifier.drain(0.05) and verifier.backlog_bytes == 2 * BLOCK
    verifier.close(timeout_s=1.0)                         # nothing running: returns at once
    gate.set()
    one.shutdown(wait=True)
    assert verifier.backlog_bytes == 0 and not verifier.admit(BLOCK)
    # Abandoned: still stored unverified, so served only where it is checked (s1: never).
    assert _extra(store)["unverified_bytes"] == 2 * BLOCK and store.get(NSID, BLOCK, b"s1") is None
    # A submit after the pool stopped gives its bytes back instead of raising.
    late = CommitVerifier(store, one)
    assert late.admit(BLOCK)
    late.submit(NSID, [(b"s0", slots[0])], BLOCK)
    assert late.backlog_bytes == 0
    store.backend.close()
