"""Same-host shared memory: memfds owned by the kvstore that clients map through
/proc/<pid>/fd/<fd> (same host, same user: the fd's permissions), proving the mapping is ours by
the random nonce at offset 0. A memfd (unlike /dev/shm files) cannot outlive the kvstore: kill -9
leaks nothing; its pages are allocated only when touched.

Two uses: the memory backend keeps its blocks in one (`SharedFile`, memory.py), and clients read
and write block slots in it in place (zero copy, transfers.py); for a backend that holds nothing
itself (Redis) `Arena` splits one into fixed windows leased one per client, which a client
writes its blocks into before a Put and the store writes found blocks into on a Get.

A window is never given to anyone else while its lease is alive; every call naming it renews
the lease; a window unused for `lease_ttl_s` is taken back only when another client needs one."""
from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass

from services.common.procs import boot_id

HEADER_BYTES = 4096
NONCE_BYTES = 32


class SharedFile:
    """A memfd of `size` bytes mapped here; its first NONCE_BYTES are random, the rest of its
    first HEADER_BYTES unused (what follows is page-aligned)."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)   # pages are allocated only when touched
        self.mm = mmap.mmap(self.fd, size)
        self.view = memoryview(self.mm)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.mm[:NONCE_BYTES] = self.nonce
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.boot_id = boot_id()

    def close(self) -> None:
        try:
            self.view.release()
            self.mm.close()
        except BufferError:   # a view still referenced (a call in flight): the process exit unmaps it
            pass
        os.close(self.fd)


@dataclass
class Lease:
    lease_id: int
    window: int
    last_used: float


class LeaseError(Exception):
    """The named window is not leased (expired and reused, or from a kvstore before a restart)."""


class Arena:
    def __init__(self, window_bytes: int, num_windows: int, lease_ttl_s: float = 30.0,
                 clock=time.monotonic) -> None:
        if window_bytes <= 0 or window_bytes % mmap.PAGESIZE or num_windows <= 0:
            raise ValueError("arena windows must be positive multiples of the page size")
        self.window_bytes = window_bytes
        self.num_windows = num_windows
        self.lease_ttl_s = lease_ttl_s
        self.size = HEADER_BYTES + window_bytes * num_windows
        self._clock = clock
        self.file = SharedFile(self.size, "meshllm-kvstore-windows")
        self.view, self.nonce, self.path, self.boot_id = self.file.view, self.file.nonce, self.file.path, self.file.boot_id
        self._leases: dict[int, Lease] = {}
        self._free = list(range(num_windows - 1, -1, -1))
        self._lock = threading.Lock()

    def open_window(self) -> Lease | None:
        """A new lease on a free window (or on the longest-idle expired one); None when every
        window is leased and alive (the client uses gRPC bytes)."""
        now = self._clock()
        with self._lock:
            if not self._free:
                expired = [lease for lease in self._leases.values() if now - lease.last_used > self.lease_ttl_s]
                if not expired:
                    return None
                oldest = min(expired, key=lambda lease: lease.last_used)
                del self._leases[oldest.lease_id]
                self._free.append(oldest.window)
            lease = Lease(secrets.randbits(63) or 1, self._free.pop(), now)
            self._leases[lease.lease_id] = lease
            return lease

    def close_window(self, lease_id: int) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._free.append(lease.window)

    def window(self, lease_id: int) -> memoryview:
        """The leased window's bytes (the lease renewed); LeaseError if it is not leased."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseError("the shared-memory window is not leased (expired or from before a restart)")
            lease.last_used = self._clock()
        start = HEADER_BYTES + lease.window * self.window_bytes
        return self.view[start:start + self.window_bytes]

    def window_offset(self, lease: Lease) -> int:
        return HEADER_BYTES + lease.window * self.window_bytes

    @property
    def leased(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self.file.close()
