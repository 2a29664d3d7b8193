"""The kvstore's shared-memory arena: a leased window is never handed to anyone else while its
lease is alive; an idle one is taken back only when a window is needed; a forgotten lease is
refused (the client then drops its mapping and uses gRPC bytes)."""
from __future__ import annotations

import mmap
import os

import pytest

from services.kvstore.arena import HEADER_BYTES, Arena, LeaseError


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
