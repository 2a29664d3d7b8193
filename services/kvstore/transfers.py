"""Zero-copy transfers in flight, each tied to the arena lease of the client that started it.

A client maps the memory backend's memfd (OpenArena with zero_copy) and gets a lease; a Pin
answers a read id for the blocks it pinned, a Reserve a reserve id for the slots it reserved.
Both live until the client names them again (Release, Commit), or until they or their lease
expire: a lease expires `ttl_s` after the last call that named it, a read or a reservation
`ttl_s` after it began. Expiry gives everything back (`on_expire`), so a client killed
mid-transfer leaks no pin and no slot. Both maps are bounded (leases, and transfers per lease).

Thread-safe; the clock is injected (tests drive it)."""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from services.kvstore.arena import LeaseError

MAX_LEASES = 256
MAX_TRANSFERS_PER_LEASE = 64


class TooManyTransfers(Exception):
    """This lease already holds MAX_TRANSFERS_PER_LEASE reads and reservations."""


@dataclass
class Transfer:
    """A read (`blocks`: the pinned extents, None for a miss) or a reservation (the reserved
    slots, the block's status where no slot was given), with the keys they belong to."""
    kind: str                      # "read" | "reserve"
    ns_id: bytes
    hashes: list[bytes]
    blocks: list                   # memory.Extent, or a store.PutStatus where there is none
    block_bytes: int
    started: float = 0.0


@dataclass
class _Lease:
    last_used: float
    transfers: dict[int, Transfer] = field(default_factory=dict)


class Transfers:
    def __init__(self, ttl_s: float, on_expire, clock=time.monotonic, max_leases: int = MAX_LEASES,
                 max_per_lease: int = MAX_TRANSFERS_PER_LEASE) -> None:
        self.ttl_s = ttl_s
        self._on_expire = on_expire        # on_expire(transfer): unpin / free, outside the lock
        self._clock = clock
        self._max_leases = max_leases
        self._max_per_lease = max_per_lease
        self._leases: dict[int, _Lease] = {}
        self._lock = threading.Lock()

    def open(self) -> int | None:
        """A new lease id; None when MAX_LEASES are alive (the client uses gRPC bytes)."""
        self.expire()
        with self._lock:
            if len(self._leases) >= self._max_leases:
                return None
            lease_id = secrets.randbits(63) or 1
            self._leases[lease_id] = _Lease(self._clock())
            return lease_id

    def close(self, lease_id: int) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for t in lease.transfers.values():
            self._on_expire(t)
        return True

    def give_back(self, transfer: Transfer) -> None:
        """What expiry does, for a transfer that never got an id."""
        self._on_expire(transfer)

    def renew(self, lease_id: int) -> None:
        """LeaseError unless the lease is alive; renewed."""
        with self._lock:
            self._renew_locked(lease_id)

    def _renew_locked(self, lease_id: int) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseError("the arena lease is not alive (expired, closed, or from before a restart)")
        lease.last_used = self._clock()
        return lease

    def add(self, lease_id: int, transfer: Transfer) -> int:
        """The transfer's id; LeaseError or TooManyTransfers (then the caller gives it back)."""
        with self._lock:
            lease = self._renew_locked(lease_id)
            if len(lease.transfers) >= self._max_per_lease:
                raise TooManyTransfers(f"at most {self._max_per_lease} reads and reservations per lease")
            transfer.started = lease.last_used
            transfer_id = secrets.randbits(63) or 1
            lease.transfers[transfer_id] = transfer
            return transfer_id

    def take(self, lease_id: int, transfer_id: int, kind: str) -> Transfer | None:
        """Remove and return a live transfer of this kind; None if it expired or never was."""
        with self._lock:
            lease = self._renew_locked(lease_id)
            t = lease.transfers.get(transfer_id)
            if t is None or t.kind != kind:
                return None
            return lease.transfers.pop(transfer_id)

    def peek(self, lease_id: int, transfer_id: int, kind: str) -> Transfer | None:
        with self._lock:
            t = self._renew_locked(lease_id).transfers.get(transfer_id)
            return t if t is not None and t.kind == kind else None

    def expire(self) -> int:
        """Give back every lease and transfer past its time; how many transfers that ended."""
        now = self._clock()
        doomed: list[Transfer] = []
        with self._lock:
            for lease_id in [i for i, lease in self._leases.items() if now - lease.last_used > self.ttl_s]:
                doomed += self._leases.pop(lease_id).transfers.values()
            for lease in self._leases.values():
                for tid in [i for i, t in lease.transfers.items() if now - t.started > self.ttl_s]:
                    doomed.append(lease.transfers.pop(tid))
        for t in doomed:
            self._on_expire(t)
        return len(doomed)

    @property
    def leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(lease.transfers) for lease in self._leases.values())
