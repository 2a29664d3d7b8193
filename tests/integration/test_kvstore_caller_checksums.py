"""Zero-copy transfers whose caller checksums the blocks itself (as the worker does on its GPU,
services/worker/kv_store_io.py): a fill that answers Filled(crcs, wait) has its checksums checked
by the store against what landed (after the Commit answers: a wrong one is served to no one and
dropped; a failed wait drops the chunk and frees its slots), the commit waits for the copies first, and a save's chunks grow from a small first
one; a consume that verifies gets the stored checksums, and what it finds corrupt is a miss,
reported, and removed once the store agrees.
Against a real kvstore process (tests/integration/test_kvstore.py's)."""
from __future__ import annotations

import threading
import time

from services.common.kv_blocks import checksum
from services.common.kv_client import Filled, KvClient
from tests.integration.test_kvstore import NS, _blocks, corrupt_in_arena, kvstore, wait_for_miss  # noqa: F401


def _empty(client: KvClient) -> None:
    stats = client.stats()
    assert stats.pinned_blocks == 0 and stats.reserved_bytes == 0 and stats.transfers == 0


def test_a_fill_with_its_own_checksums_is_committed_after_its_copies_and_checked(kvstore):
    client = KvClient(kvstore.addr, chunk_bytes=3 * len(_blocks(1, b"x")[0][1]))
    blocks = _blocks(8, b"own-crc-")
    hashes = [h for h, _ in blocks]
    order = []

    def fill(start, idx, views):
        landed = threading.Event()

        def copy() -> None:   # the copies land later, as a DMA's would
            time.sleep(0.05)
            for k, v in zip(idx, views):
                v[:] = blocks[k][1]
            order.append(("copied", start))
            landed.set()
        threading.Thread(target=copy).start()
        crcs = [checksum(blocks[k][1]) for k in idx]
        if start == 3:
            crcs[1] ^= 1          # block 4: a wrong checksum, dropped by the store

        def wait() -> None:
            landed.wait()
            order.append(("waited", start))
        return Filled(crcs, wait)

    try:
        before = client.stats().corrupt_blocks
        assert client.write_zero_copy(NS, hashes, fill) == 8   # Commit answers before the store's check
        assert all(order.index(("copied", s)) < order.index(("waited", s)) for s in (0, 3, 6))
        assert client.get(NS, hashes[4:5]) == [None]     # never served, whenever it is asked for
        wait_for_miss(client, NS, hashes[4])
        assert client.lookup(NS, hashes) == 4            # dropped: the chain stops there
        assert client.stats().corrupt_blocks == before + 1
        assert client.get(NS, hashes[5:]) == [d for _, d in blocks[5:]]
        _empty(client)
    finally:
        client.close()


def test_a_fill_whose_copies_fail_or_whose_checksums_miscount_is_dropped(kvstore):
    client = KvClient(kvstore.addr)
    blocks = _blocks(3, b"bad-wait-")
    hashes = [h for h, _ in blocks]

    def failing(start, idx, views):
        def wait() -> None:
            raise RuntimeError("the device copy failed")
        return Filled([checksum(blocks[k][1]) for k in idx], wait)

    def short(start, idx, views):
        for k, v in zip(idx, views):
            v[:] = blocks[k][1]
        return Filled([checksum(blocks[idx[0]][1])])

    try:
        assert client.write_zero_copy(NS, hashes, failing) == 0 and client.lookup(NS, hashes) == 0
        assert client.write_zero_copy(NS, hashes, short) == 0 and client.lookup(NS, hashes) == 0
        _empty(client)
        # A fill answering anything but a Filled is checksummed by the client, as before.
        assert client.write_zero_copy(NS, hashes, lambda s, idx, views: [
            v.__setitem__(slice(None), blocks[k][1]) for k, v in zip(idx, views)]) == 3
        assert client.get(NS, hashes) == [d for _, d in blocks]
    finally:
        client.close()


def test_a_consume_that_verifies_gets_the_stored_checksums_and_its_corrupt_blocks_are_misses(kvstore):
    blocks = _blocks(4, b"own-verify-")
    client = KvClient(kvstore.addr, chunk_bytes=2 * len(blocks[0][1]))   # two blocks a chunk
    hashes = [h for h, _ in blocks]
    calls = []

    def verify(start, views, crcs):   # as the worker does: copies up to the first miss, then checks
        calls.append((start, [c is not None for c in crcs]))
        k = next((i for i, v in enumerate(views) if v is None), len(views))
        return [checksum(v) == c for v, c in zip(views[:k], crcs[:k])] + [None] * (len(views) - k)

    try:
        assert client.put(NS, blocks) == 4
        assert client.read_zero_copy(NS, hashes[:2] + [b"absent"] + hashes[2:], verify,
                                     consumer_verifies=True) == [True, True, False, False, False]
        assert calls == [(0, [True, True]), (2, [False, True])]   # the load ends at the miss
        before = client.stats().corrupt_blocks
        corrupt_in_arena(kvstore.addr, NS, hashes[1])
        # The load ends after the chunk with the corrupt block: the next one is never pinned.
        assert client.read_zero_copy(NS, hashes, verify, consumer_verifies=True) == [True, False, False, False]
        assert calls[-1][0] == 0
        assert client.stats().corrupt_blocks == before + 1 and client.lookup(NS, hashes) == 1   # removed
        # A consumer that calls a sound block corrupt: a miss, but the store keeps it (it checks).
        assert client.read_zero_copy(NS, hashes[:1], lambda s, views, crcs: [False],
                                     consumer_verifies=True) == [False]
        assert client.lookup(NS, hashes[:1]) == 1
        # One that raises: misses, nothing left pinned.
        assert client.read_zero_copy(NS, hashes[:1], lambda *_: 1 / 0, consumer_verifies=True) == [False]
        _empty(client)
    finally:
        client.close()


def test_a_save_starts_with_a_small_chunk_and_doubles_up_to_the_write_chunk(kvstore):
    blocks = _blocks(12, b"spans-")
    bb = len(blocks[0][1])
    client = KvClient(kvstore.addr, chunk_bytes=16 * bb, write_chunk_bytes=4 * bb, first_write_bytes=bb)
    spans = []

    def fill(start, idx, views):
        spans.append((start, len(idx)))
        for k, v in zip(idx, views):
            v[:] = blocks[k][1]
        return Filled([checksum(blocks[k][1]) for k in idx])   # no wait: already there

    try:
        assert client.write_zero_copy(NS, [h for h, _ in blocks], fill) == 12
        assert spans == [(0, 1), (1, 2), (3, 4), (7, 4), (11, 1)]
        assert client.get(NS, [h for h, _ in blocks]) == [d for _, d in blocks]
        _empty(client)
    finally:
        client.close()


def test_a_tapered_save_ends_with_chunks_halving_down_to_the_last_write_chunk(kvstore):
    blocks = _blocks(20, b"taper-")
    bb = len(blocks[0][1])
    client = KvClient(kvstore.addr, chunk_bytes=16 * bb, write_chunk_bytes=4 * bb, first_write_bytes=bb,
                      last_write_bytes=bb)
    spans = []

    def fill(start, idx, views):
        spans.append((start, len(idx)))
        for k, v in zip(idx, views):
            v[:] = blocks[k][1]
        return Filled([checksum(blocks[k][1]) for k in idx])

    try:
        assert client.write_zero_copy(NS, [h for h, _ in blocks], fill) == 20
        sizes = [n for _, n in spans]
        assert sizes[0] == 1 and sizes[-1] == 1 and max(sizes) == 4 and sum(sizes) == 20, sizes
        assert [s for s, _ in spans] == [sum(sizes[:i]) for i in range(len(sizes))]   # in order, no gap
        peak = len(sizes) - sizes[::-1].index(4)
        assert sizes[:3] == [1, 2, 4] and sizes[-2:] == [2, 1], sizes
        assert all(a >= b for a, b in zip(sizes[peak - 1:], sizes[peak:])), sizes   # tapers after the last full chunk
        assert client.get(NS, [h for h, _ in blocks]) == [d for _, d in blocks]
        _empty(client)
    finally:
        client.close()


def test_checksums_answered_later_are_fetched_by_the_commit_and_checked_or_abort_the_chunk(kvstore):
    """Filled(checksums=callable): called on the commit thread after the copies' wait (as the
    worker's device checksums are fetched); a wrong one is dropped by the store, one that raises
    gives the chunk's slots back and the other chunks are still stored."""
    blocks = _blocks(9, b"lazy-crc-")
    bb = len(blocks[0][1])
    client = KvClient(kvstore.addr, chunk_bytes=3 * bb)
    hashes = [h for h, _ in blocks]
    calls = []

    def fill(start, idx, views):
        for k, v in zip(idx, views):
            v[:] = blocks[k][1]
        waited = threading.Event()

        def crcs():
            assert waited.is_set(), "checksums asked for before the copies' wait"
            calls.append(start)
            if start == 6:
                raise RuntimeError("device checksum failed")
            out = [checksum(blocks[k][1]) for k in idx]
            if start == 3:
                out[0] ^= 1     # block 3: wrong, dropped
            return out
        return Filled(crcs, waited.set)

    try:
        assert client.write_zero_copy(NS, hashes, fill) == 6   # chunk 6..8 aborted
        assert sorted(calls) == [0, 3, 6]
        wait_for_miss(client, NS, hashes[3])
        assert client.lookup(NS, hashes) == 3
        assert client.get(NS, hashes[4:6]) == [d for _, d in blocks[4:6]]
        assert client.get(NS, hashes[6:]) == [None] * 3
        _empty(client)
    finally:
        client.close()
