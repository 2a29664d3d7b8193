"""The kvstore's shared memory: a leased window is never handed to anyone else while its lease is
alive; an idle one is taken back only when a window is needed; a forgotten lease is refused (the
client then drops its mapping and uses gRPC bytes). Zero copy: a client maps the memory backend's
memfd and reads / writes blocks in place; the pins and slots of an expired lease, or of a read or
reservation older than the lease TTL, are given back; leases and transfers are bounded."""
from __future__ import annotations

import mmap
import os

import pytest

from services.common.kv_blocks import checksum
from services.kvstore.arena import HEADER_BYTES, Arena, LeaseError
from services.kvstore.memory import MemoryBackend
from services.kvstore.server import zero_copy_transfers
from services.kvstore.store import PutStatus, Store
from services.kvstore.transfers import TooManyTransfers, Transfer


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_windows_are_disjoint_and_never_reused_while_leased():
    clock = Clock()
    arena = Arena(mmap.PAGESIZE * 4, 3, lease_ttl_s=10.0, clock=clock)
    leases = [arena.open_window() for _ in range(3)]
    assert len({arena.window_offset(lease) for lease in leases}) == 3
    assert arena.open_window() is None                 # all leased and alive: gRPC bytes
    clock.t = 9.0
    arena.window(leases[0].lease_id)                   # a call renews the lease
    clock.t = 15.0                                     # 1 and 2 idle > ttl, 0 renewed at 9
    taken = arena.open_window()
    assert taken is not None and taken.window in (leases[1].window, leases[2].window)
    with pytest.raises(LeaseError):
        arena.window(leases[1].lease_id if taken.window == leases[1].window else leases[2].lease_id)
    assert len(arena.window(leases[0].lease_id)) == mmap.PAGESIZE * 4
    arena.close_window(leases[0].lease_id)
    assert arena.open_window().window == leases[0].window
    arena.close()


def test_a_client_maps_the_arena_by_its_proc_path_and_sees_the_stores_bytes():
    arena = Arena(mmap.PAGESIZE, 2)
    lease = arena.open_window()
    arena.window(lease.lease_id)[:5] = b"hello"
    fd = os.open(arena.path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert mm[:len(arena.nonce)] == arena.nonce
    off = arena.window_offset(lease)
    assert off >= HEADER_BYTES and mm[off:off + 5] == b"hello"
    mm[off:off + 5] = b"HELLO"                         # the client's writes are the store's bytes
    assert bytes(arena.window(lease.lease_id)[:5]) == b"HELLO"
    mm.close()
    arena.close()


# ---- zero copy: the memory backend's memfd, and transfers tied to leases ----------------------
BLOCK = 4 * mmap.PAGESIZE
NSID = b"n" * 16


def _store_and_transfers(clock: Clock, capacity_blocks: int = 4, **kw):
    store = Store(MemoryBackend(capacity_blocks * BLOCK))
    return store, zero_copy_transfers(store, 10.0, clock=clock, **kw)


def _put(store: Store, h: bytes, fill: int) -> None:
    data = bytes([fill]) * BLOCK
    assert store.put(NSID, BLOCK, h, data, checksum(data)) == PutStatus.STORED


def test_a_client_maps_the_block_memory_and_reads_and_writes_blocks_in_place():
    store, _ = _store_and_transfers(Clock())
    _put(store, b"a", 1)
    fd = os.open(store.arena.path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert mm[:len(store.arena.nonce)] == store.arena.nonce and len(mm) == store.arena.size
    (pin,) = store.pin(NSID, BLOCK, [b"a"])
    assert pin.offset >= HEADER_BYTES and mm[pin.offset:pin.offset + BLOCK] == bytes([1]) * BLOCK
    store.unpin([pin])
    (slot,) = store.reserve(NSID, BLOCK, [b"b"])
    mm[slot.offset:slot.offset + BLOCK] = bytes([2]) * BLOCK      # the client's write is the store's block
    assert store.commit(NSID, BLOCK, [b"b"], [slot], [checksum(bytes([2]) * BLOCK)]) == [PutStatus.STORED]
    assert store.get(NSID, BLOCK, b"b")[0] == bytes([2]) * BLOCK
    mm.close()
    store.backend.close()


def test_an_expired_lease_gives_back_its_pins_and_slots():
    clock = Clock()
    store, transfers = _store_and_transfers(clock)
    _put(store, b"a", 1)
    lease = transfers.open()
    read = transfers.add(lease, Transfer("read", NSID, [b"a"], store.pin(NSID, BLOCK, [b"a"]), BLOCK))
    transfers.add(lease, Transfer("reserve", NSID, [b"b", b"c"], store.reserve(NSID, BLOCK, [b"b", b"c"]), BLOCK))
    s = store.backend.stats()
    assert s.extra["pins"] == 1 and s.extra["reserved_bytes"] == 2 * BLOCK and transfers.in_flight() == 2
    clock.t = 9.0
    transfers.expire()
    assert transfers.in_flight() == 2                         # not yet
    clock.t = 10.5                                            # the client was killed: no call renewed it
    assert transfers.expire() == 2
    s = store.backend.stats()
    assert s.extra["pins"] == 0 and s.extra["reserved_bytes"] == 0 and s.extra["free_bytes"] == 3 * BLOCK
    assert transfers.leases == 0
    with pytest.raises(LeaseError):
        transfers.take(lease, read, "read")                   # a late Release: the lease is gone
    for i, h in enumerate((b"x", b"y", b"z", b"w")):           # every slot is usable again
        _put(store, h, 10 + i)
    store.backend.close()


def test_a_forgotten_read_or_reservation_expires_even_while_its_lease_is_used():
    clock = Clock()
    store, transfers = _store_and_transfers(clock)
    _put(store, b"a", 1)
    lease = transfers.open()
    transfers.add(lease, Transfer("read", NSID, [b"a"], store.pin(NSID, BLOCK, [b"a"]), BLOCK))
    (slot,) = store.reserve(NSID, BLOCK, [b"b"])
    rid = transfers.add(lease, Transfer("reserve", NSID, [b"b"], [slot], BLOCK))
    for t in (4.0, 8.0, 10.5):                                # other calls keep the lease alive
        clock.t = t
        transfers.renew(lease)
        transfers.expire()
    assert transfers.leases == 1 and transfers.in_flight() == 0
    assert transfers.take(lease, rid, "reserve") is None      # a late Commit finds nothing to commit
    s = store.backend.stats()
    assert s.extra["pins"] == 0 and s.extra["reserved_bytes"] == 0
    transfers.close(lease)
    store.backend.close()


def test_leases_and_transfers_per_lease_are_bounded_and_a_closed_lease_gives_everything_back():
    clock = Clock()
    store, transfers = _store_and_transfers(clock, max_leases=2, max_per_lease=2)
    _put(store, b"a", 1)
    one, two = transfers.open(), transfers.open()
    assert one and two and transfers.open() is None           # full: the client uses gRPC bytes
    for _ in range(2):
        transfers.add(one, Transfer("read", NSID, [b"a"], store.pin(NSID, BLOCK, [b"a"]), BLOCK))
    extra = Transfer("read", NSID, [b"a"], store.pin(NSID, BLOCK, [b"a"]), BLOCK)
    with pytest.raises(TooManyTransfers):
        transfers.add(one, extra)
    transfers.give_back(extra)
    assert store.backend.stats().extra["pins"] == 2
    transfers.close(one)
    assert store.backend.stats().extra["pins"] == 0 and transfers.open() is not None
    with pytest.raises(LeaseError):
        transfers.renew(one)
    store.backend.close()
