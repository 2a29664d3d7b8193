"""The kvstore's rules over any backend: a block's bytes must match the checksum its writer
sent and the size its namespace declares; a read hands out only verified bytes; hits, misses
and refusals are counted. Values in, values out (the gRPC adapter is server.py)."""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from services.common.kv_blocks import copy_and_checksum
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
        return self.put_batch(ns_id, block_bytes, [(block_hash, data, claimed_crc)])[0]

    def put_batch(self, ns_id: bytes, block_bytes: int, blocks: list[tuple[bytes, object, int]],
                  map_fn=map) -> list[PutStatus]:
        """Store (hash, bytes-like, claimed crc) blocks of one hash chain, first block first.

        Each block's bytes (a shared-memory window included) are copied once and the copy is
        what is checked, so a writer changing its buffer meanwhile gains nothing; `map_fn` runs
        those copies (a thread pool's map: they release the GIL). The checked blocks enter the
        backend last block first, so the chain's head is the most recently used and the LRU
        evicts a chain from its tail: what stays stored is still a prefix."""
        def check(block) -> tuple[PutStatus | None, bytearray | None]:
            _, data, crc = block
            if len(data) != block_bytes:
                return PutStatus.BAD_SIZE, None
            raw = bytearray(block_bytes)   # never mutated once stored
            if copy_and_checksum(raw, data) != crc:
                return PutStatus.BAD_CHECKSUM, None
            return None, raw

        checked = list(map_fn(check, blocks))
        statuses: list[PutStatus] = [PutStatus.FAILED] * len(blocks)
        for i in range(len(blocks) - 1, -1, -1):
            status, raw = checked[i]
            if status is None:
                status = _OUTCOME[self.backend.put((ns_id, blocks[i][0]), raw, blocks[i][2])]
            statuses[i] = status
        kept = sum(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)
        with self._lock:
            self.counters.bytes_in += kept * block_bytes
            self.counters.refused += len(blocks) - kept
        return statuses

    def get(self, ns_id: bytes, block_bytes: int, block_hash: bytes) -> tuple[bytes, int] | None:
        return self.get_batch(ns_id, block_bytes, [block_hash])[0]

    def get_batch(self, ns_id: bytes, block_bytes: int, hashes: list[bytes],
                  map_fn=map) -> list[tuple[bytes, int] | None]:
        """Each block's verified (bytes, crc), or None. The found blocks are then marked used
        last block first, for the same reason as in put_batch."""
        def one(h: bytes):
            found = self.backend.get((ns_id, h))
            if found is not None and len(found[0]) != block_bytes:
                return None   # cannot happen through put(); never hand out a wrong-sized block
            return found

        out = list(map_fn(one, hashes))
        hits = [(ns_id, h) for h, f in zip(hashes, out) if f is not None]
        if len(hits) > 1:
            self.backend.touch(hits[::-1])
        with self._lock:
            self.counters.hits += len(hits)
            self.counters.misses += len(hashes) - len(hits)
            self.counters.bytes_out += len(hits) * block_bytes
        return out

    def lookup(self, ns_id: bytes, hashes: list[bytes]) -> int:
        return self.backend.contains([(ns_id, h) for h in hashes])

    def flush(self, ns_id: bytes | None) -> int:
        return self.backend.flush(ns_id)

    def stats(self) -> tuple[BackendStats, StoreCounters]:
        with self._lock:
            counters = StoreCounters(**vars(self.counters))
        return self.backend.stats(), counters
