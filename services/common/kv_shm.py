"""The kvstore client's same-host shared memory (docs/kvstore.md): the store's block memory mapped
whole (zero copy: blocks read and written in place) or a window leased to this client (the Redis
backend's plane). Both are the store's memfds, reached through /proc/<pid>/fd/<fd> and proved to
be the store's by the random nonce at their start."""
from __future__ import annotations

import mmap
import os
import threading

from services.common.kv_blocks import kv_pb2
from services.common.procs import boot_id  # noqa: F401 - kv_link imports it from here


def map_shared(resp: "kv_pb2.OpenArenaResponse", size: int) -> mmap.mmap:
    """Map the first `size` bytes of the store's memfd, checked to be the store's: the path
    names a pid's fd, which on another host or after pid reuse is someone else's."""
    fd = os.open(resp.path, os.O_RDWR)
    try:
        if not len(resp.nonce) < size <= os.fstat(fd).st_size:
            raise OSError("the shared memory is smaller than the kvstore says")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mm[:len(resp.nonce)] != resp.nonce:
        mm.close()
        raise OSError("the mapping is not the kvstore's shared memory")
    return mm


def unmap(mm: mmap.mmap, view: memoryview) -> None:
    view.release()
    try:
        mm.close()
    except BufferError:   # a caller kept a view: the mapping goes with its last reference
        pass


def release_view(view: memoryview | None) -> None:
    if view is not None:
        try:
            view.release()
        except BufferError:   # the caller kept something made from it; it goes when they drop it
            pass


class Window:
    """This client's leased window of the kvstore's shared memory (the Redis backend's plane)."""

    def __init__(self, resp: "kv_pb2.OpenArenaResponse") -> None:
        self._mm = map_shared(resp, resp.window_offset + resp.window_bytes)
        self.lease = kv_pb2.ShmWindow(lease_id=resp.lease_id)
        self.view = memoryview(self._mm)[resp.window_offset:resp.window_offset + resp.window_bytes]
        self.size = resp.window_bytes
        self.lock = threading.Lock()

    def close(self) -> None:
        unmap(self._mm, self.view)


class ArenaMapping:
    """The kvstore's block memory (its memfd) mapped here whole, read-write: zero-copy reads and
    writes name offsets in it. Unmapped only once retired and no transfer uses it (`users` and
    `retired` are kept under the client's lock)."""

    def __init__(self, resp: "kv_pb2.OpenArenaResponse") -> None:
        self.mm = map_shared(resp, resp.arena_bytes)
        self.nonce = resp.nonce
        self.size = resp.arena_bytes
        self.view = memoryview(self.mm)
        self.users = 0          # transfers using it now
        self.retired = False

    def slot(self, offset: int, size: int) -> memoryview | None:
        """The block at [offset, offset + size), or None when the store named bytes outside the
        arena (or its nonce): an answer is never trusted blindly."""
        if offset < len(self.nonce) or size <= 0 or offset + size > self.size:
            return None
        return self.view[offset:offset + size]

    def close(self) -> None:
        unmap(self.mm, self.view)
