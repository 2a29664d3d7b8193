"""The kvstore's rules over any backend: a block's bytes must match the checksum its writer
sent and the size its namespace declares (checked before it is stored, or for a zero-copy
commit, after: commit(verify=False) and check_committed()); a read hands out only verified
bytes (or, zero copy, pinned bytes the reader verifies and reports); hits, misses and refusals
are counted. Values in,
values out (the gRPC adapter is server.py; the leases that zero-copy transfers belong to,
transfers.py)."""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from services.common.kv_blocks import checksum, copy_and_checksum
from services.kvstore.backend import Backend, BackendStats, PutOutcome


class PutStatus(enum.Enum):
    RESERVED = "reserved"      # Reserve: a slot is held for the block until Commit
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
        # The memory backend keeps its blocks in a shared memfd: reads pin them, writes reserve
        # and commit slots (zero copy). Redis keeps nothing here: bytes are copied in and out.
        self.arena = getattr(backend, "arena", None)

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
        if self.arena is not None:
            return self._put_in_place(ns_id, block_bytes, blocks, map_fn)

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
        self._count(statuses, block_bytes)
        return statuses

    def _put_in_place(self, ns_id: bytes, block_bytes: int, blocks, map_fn) -> list[PutStatus]:
        """Reserve, copy in (checked as it lands), commit: the copy into the slot is the only one."""
        hashes = [h for h, _, _ in blocks]
        slots = [PutStatus.BAD_SIZE if len(data) != block_bytes else None for _, data, _ in blocks]
        fit = [i for i, s in enumerate(slots) if s is None]
        for i, slot in zip(fit, self._reserve(ns_id, block_bytes, [hashes[i] for i in fit])):
            slots[i] = slot

        def fill(i: int) -> int | None:
            slot = slots[i]
            return None if isinstance(slot, PutStatus) else copy_and_checksum(self.backend.view(slot), blocks[i][1])

        landed = list(map_fn(fill, range(len(blocks))))
        statuses = self._commit(ns_id, hashes, slots, [c for _, _, c in blocks], landed)
        self._count(statuses, block_bytes)
        return statuses

    # ---- zero copy: pins, and slots reserved then committed ---------------------------------
    def pin(self, ns_id: bytes, block_bytes: int, hashes: list[bytes]) -> list:
        """Each found block's extent, pinned (its bytes unverified: the reader checks them and
        reports the corrupt ones to release()), or None. Marked used last block first."""
        out = []
        for h in hashes:
            ext = self.backend.pin((ns_id, h))
            if ext is not None and ext.size != block_bytes:   # cannot happen through put()
                self.backend.unpin(ext)
                ext = None
            out.append(ext)
        self._count_read(ns_id, block_bytes, hashes, out)
        return out

    def release(self, ns_id: bytes, hashes: list[bytes], pinned: list, corrupt: list[int], map_fn=map) -> int:
        """Unpin a read. The blocks its reader found corrupt are checked again here (a reader's
        word alone never deletes a block) and the truly corrupt ones removed; how many were."""
        reported = sorted(i for i in set(corrupt) if pinned[i] is not None)
        bad = sum(not ok for ok in map_fn(lambda i: self.backend.verify((ns_id, hashes[i]), pinned[i]), reported))
        self.unpin(pinned)
        return bad

    def unpin(self, pinned: list) -> None:
        for ext in pinned:
            if ext is not None:
                self.backend.unpin(ext)

    def reserve(self, ns_id: bytes, block_bytes: int, hashes: list[bytes]) -> list:
        """A slot (an extent to write into) per block not stored yet, first block first (short
        of room, the chain's head gets slots and its tail is dropped), else the block's status:
        EXISTS, TOO_LARGE, or FAILED (no room: everything else is pinned or reserved)."""
        out = self._reserve(ns_id, block_bytes, hashes)
        self._count([s for s in out if isinstance(s, PutStatus)], block_bytes)
        return out

    def _reserve(self, ns_id: bytes, block_bytes: int, hashes: list[bytes]) -> list:
        out = []
        for h in hashes:
            r = self.backend.reserve((ns_id, h), block_bytes)
            out.append(_OUTCOME[r] if isinstance(r, PutOutcome) else r)
        return out

    def commit(self, ns_id: bytes, block_bytes: int, hashes: list[bytes], slots: list, claimed: list[int],
               map_fn=map, verify: bool = True) -> list[PutStatus]:
        """Make the reserved slots visible with their writer's CRC-32C, last block first.
        verify: each slot's bytes are checked first (`map_fn`: in parallel) and a mismatch is
        refused (BAD_CHECKSUM) and its slot freed; False: they are stored unverified, and each
        STORED one must be given to check_committed(). `slots` are reserve()'s answers."""
        def landed(i: int) -> int | None:
            if isinstance(slots[i], PutStatus):
                return None
            return checksum(self.backend.view(slots[i])) if verify else claimed[i]

        statuses = self._commit(ns_id, hashes, slots, claimed, list(map_fn(landed, range(len(slots)))), verify)
        self._count([s for s, slot in zip(statuses, slots) if not isinstance(slot, PutStatus)], block_bytes)
        return statuses

    def _commit(self, ns_id, hashes, slots, claimed, landed, verified: bool = True) -> list[PutStatus]:
        statuses = [s if isinstance(s, PutStatus) else PutStatus.FAILED for s in slots]
        for i in range(len(slots) - 1, -1, -1):   # the chain's head ends most recently used
            if isinstance(slots[i], PutStatus):
                continue
            if landed[i] != claimed[i]:
                self.backend.abort(slots[i])
                statuses[i] = PutStatus.BAD_CHECKSUM
            else:
                statuses[i] = _OUTCOME[self.backend.commit((ns_id, hashes[i]), slots[i], claimed[i], verified)]
        return statuses

    def check_committed(self, ns_id: bytes, block_hash: bytes, slot) -> bool | None:
        """Check a block that commit(verify=False) stored: True: sound; False: its bytes did not
        match its writer's checksum and it is gone (a miss from now on); None: nothing to check
        (removed or verified meanwhile)."""
        return self.backend.check_committed((ns_id, block_hash), slot)

    def abort(self, slots: list) -> None:
        """Free reserved slots without storing them (the writer gave up, or its lease expired)."""
        for slot in slots:
            if slot is not None and not isinstance(slot, PutStatus):
                self.backend.abort(slot)

    def _count(self, statuses: list[PutStatus], block_bytes: int) -> None:
        kept = sum(s in (PutStatus.STORED, PutStatus.EXISTS) for s in statuses)
        with self._lock:
            self.counters.bytes_in += kept * block_bytes
            self.counters.refused += len(statuses) - kept

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
        self._count_read(ns_id, block_bytes, hashes, out)
        return out

    def _count_read(self, ns_id: bytes, block_bytes: int, hashes: list[bytes], found: list) -> None:
        """The found blocks (not None) are marked used last block first; hits and misses counted."""
        hits = [(ns_id, h) for h, f in zip(hashes, found) if f is not None]
        if len(hits) > 1:
            self.backend.touch(hits[::-1])
        with self._lock:
            self.counters.hits += len(hits)
            self.counters.misses += len(hashes) - len(hits)
            self.counters.bytes_out += len(hits) * block_bytes

    def lookup(self, ns_id: bytes, hashes: list[bytes]) -> int:
        return self.backend.contains([(ns_id, h) for h in hashes])

    def flush(self, ns_id: bytes | None) -> int:
        return self.backend.flush(ns_id)

    def stats(self) -> tuple[BackendStats, StoreCounters]:
        with self._lock:
            counters = StoreCounters(**vars(self.counters))
        return self.backend.stats(), counters
