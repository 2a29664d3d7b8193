"""The kvstore's rules over any backend: a block's bytes must match the checksum its writer
sent and the size its namespace declares; a read hands out only verified bytes; hits, misses
and refusals are counted. Values in, values out (the gRPC adapter is server.py)."""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from services.common.kv_blocks import checksum
from services.kvstore.backend import Backend, BackendStats, PutOutcome


class PutStatus(enum.Enum):
    STORED = "stored"
    EXISTS = "exists"
    BAD_CHECKSUM = "bad_checksum"
    BAD_SIZE = "bad_size"
    TOO_LARGE = "too_large"
    FAILED = "failed"


_OUTCOME = {PutOutcome.STORED: PutStatus.STORED, PutOutcome.EXISTS: PutStatus.EXISTS,
            PutOutcome.TOO_LARGE: PutStatus.TOO_LARGE, PutOutcome.FAILED: PutStatus.FAILED}


@dataclass
class StoreCounters:
    hits: int = 0
    misses: int = 0
    refused: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class Store:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.counters = StoreCounters()
        self._lock = threading.Lock()

    def put(self, ns_id: bytes, block_bytes: int, block_hash: bytes, data, claimed_crc: int) -> PutStatus:
        """`data` is any bytes-like object (a shared-memory window included): it is copied once,
        and the copy is what is checked, so a writer changing its buffer meanwhile gains nothing."""
        if len(data) != block_bytes:
            status = PutStatus.BAD_SIZE
        else:
            raw = bytes(data)
            if checksum(raw) != claimed_crc:
                status = PutStatus.BAD_CHECKSUM
            else:
                status = _OUTCOME[self.backend.put((ns_id, block_hash), raw, claimed_crc)]
        with self._lock:
            if status in (PutStatus.STORED, PutStatus.EXISTS):
                self.counters.bytes_in += block_bytes
            else:
                self.counters.refused += 1
        return status

    def get(self, ns_id: bytes, block_bytes: int, block_hash: bytes) -> tuple[bytes, int] | None:
        found = self.backend.get((ns_id, block_hash))
        if found is not None and len(found[0]) != block_bytes:
            found = None   # cannot happen through put(); never hand out a wrong-sized block
        with self._lock:
            if found is None:
                self.counters.misses += 1
            else:
                self.counters.hits += 1
                self.counters.bytes_out += block_bytes
        return found

    def lookup(self, ns_id: bytes, hashes: list[bytes]) -> int:
        return self.backend.contains([(ns_id, h) for h in hashes])

    def flush(self, ns_id: bytes | None) -> int:
        return self.backend.flush(ns_id)

    def stats(self) -> tuple[BackendStats, StoreCounters]:
        with self._lock:
            counters = StoreCounters(**vars(self.counters))
        return self.backend.stats(), counters
