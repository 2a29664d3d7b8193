"""The host-memory tier: blocks kept inside one memfd of exactly the capacity (arena.SharedFile:
a header page, then the blocks), placed by an extent allocator (extents.py) and evicted LRU, with
an optional spill tier (disk.py) that receives what is evicted and is read through on a miss.

Same-host clients map the memfd and read or write block slots in place (zero copy): a read
*pins* a block (an evicted or flushed block's extent is never reused while it is pinned), a
write *reserves* a slot and *commits* it, its bytes checked first or (verified=False) after, by
check_committed() on the store's verifier (verifier.py). An unverified block is served only to
readers that check it themselves (pins), is checked by get() like any other, and is checked
before it spills to disk: the disk only ever holds verified blocks. The capacity is a hard bound
by construction: stored, reserved and pinned extents all live inside the memfd."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from services.common.kv_blocks import checksum, copy_into
from services.kvstore.arena import HEADER_BYTES, SharedFile
from services.kvstore.backend import BackendStats, BlockKey, PutOutcome
from services.kvstore.extents import ExtentAllocator, aligned


@dataclass(eq=False)
class Extent:
    """A block's bytes in the arena: [offset, offset + size) of the memfd (offset counts the
    header page, so it is what a client that maps the whole memfd uses)."""
    offset: int
    size: int
    crc: int = 0
    pins: int = 0          # readers', and the commit verifier's while it reads the bytes
    stored: bool = False   # in the LRU (visible to reads); False: reserved, or removed while pinned
    verified: bool = True  # False: committed with its writer's checksum, not re-checked yet


class MemoryBackend:
    """OrderedDict order is the LRU order: the first entry is the least recently used."""

    def __init__(self, capacity_bytes: int, spill=None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        self._alloc = ExtentAllocator(capacity_bytes)
        if self._alloc.capacity == 0:
            raise ValueError("capacity must hold at least one aligned extent")
        self.capacity_bytes = capacity_bytes
        self.arena = SharedFile(HEADER_BYTES + self._alloc.capacity, "meshllm-kvstore-blocks")
        self.spill = spill                   # a DiskTier, or None
        self.name = "memory+disk" if spill is not None else "memory"
        self._blocks: OrderedDict[BlockKey, Extent] = OrderedDict()
        self._bytes = 0            # of stored blocks
        self._reserved = 0         # bytes of reserved slots
        self._pins = 0             # readers' pins held (a block pinned by two readers counts twice)
        self._unverified = 0       # bytes of stored blocks not re-checked since their commit
        self._lock = threading.Lock()
        self.evictions = 0
        self.corrupt_blocks = 0
        self.commit_mismatches = 0   # unverified blocks whose bytes did not match their writer's checksum

    def view(self, ext: Extent) -> memoryview:
        return self.arena.view[ext.offset:ext.offset + ext.size]

    # ---- slots: reserve, fill (the caller), commit or abort ------------------------------
    def reserve(self, key: BlockKey, size: int) -> Extent | PutOutcome:
        """A slot of `size` bytes for `key` (LRU blocks that are not pinned are evicted to make
        room); EXISTS when the block is stored already (refreshed), TOO_LARGE when it could never
        fit, FAILED when every block that could make room is pinned or reserved."""
        if aligned(size) > self._alloc.capacity:
            return PutOutcome.TOO_LARGE
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return PutOutcome.EXISTS
        if self.spill is not None and self.spill.touch(key):
            return PutOutcome.EXISTS      # a read brings it back to memory when it is wanted
        with self._lock:
            ext, evicted = self._allocate(size)
            if ext is not None:
                self._reserved += ext.size
        self._spill(evicted)
        return ext if ext is not None else PutOutcome.FAILED

    def commit(self, key: BlockKey, ext: Extent, crc: int, verified: bool = True) -> PutOutcome:
        """Make a reserved slot the stored block `key`, the most recently used; EXISTS (and the
        slot freed) if another writer stored it meanwhile. verified: the caller checked its
        bytes against `crc`; False: check_committed() will."""
        with self._lock:
            return self._commit_locked(key, ext, crc, verified)

    def _commit_locked(self, key: BlockKey, ext: Extent, crc: int, verified: bool = True) -> PutOutcome:
        self._reserved -= ext.size
        if key in self._blocks:
            self._blocks.move_to_end(key)
            self._free(ext)
            return PutOutcome.EXISTS
        ext.crc, ext.stored, ext.verified = crc, True, verified
        self._blocks[key] = ext
        self._bytes += ext.size
        if not verified:
            self._unverified += ext.size
        return PutOutcome.STORED

    def check_committed(self, key: BlockKey, ext: Extent) -> bool | None:
        """The verifier's check of a block committed unverified: True (now verified), False (its
        bytes do not match its writer's checksum: removed and counted), None (nothing to do: no
        longer stored, or verified meanwhile by a read). Its extent is held while it is read, so
        it is neither evicted nor reused meanwhile; its place in the LRU does not change."""
        with self._lock:
            if self._blocks.get(key) is not ext or ext.verified:
                return None
            ext.pins += 1      # not a reader's pin: Stats' pinned_blocks does not count it
        ok = checksum(self.view(ext)) == ext.crc
        with self._lock:
            ext.pins -= 1
            if self._blocks.get(key) is not ext:     # removed meanwhile
                if not ext.pins:
                    self._free(ext)
                return None
            if ok:
                self._mark_verified_locked(ext)
            else:
                self._drop_corrupt_locked(key, ext)
        return ok

    def _mark_verified_locked(self, ext: Extent) -> None:
        if not ext.verified:
            ext.verified = True
            if ext.stored:
                self._unverified -= ext.size

    def abort(self, ext: Extent) -> None:
        with self._lock:
            self._reserved -= ext.size
            self._free(ext)

    def _allocate(self, size: int) -> tuple[Extent | None, list[tuple[BlockKey, bytes, int]]]:
        """Under the lock. Evicts the least recently used unpinned blocks until an extent fits;
        their bytes are copied out for the spill tier before the extent can be reused."""
        evicted = []
        while True:
            offset = self._alloc.allocate(size)
            if offset is not None:
                return Extent(HEADER_BYTES + offset, size), evicted
            victim = next((k for k, e in self._blocks.items() if not e.pins), None)
            if victim is None:
                return None, evicted
            ext = self._unlink_locked(victim)
            self.evictions += 1
            if self.spill is not None:
                evicted.append((victim, bytes(self.view(ext)), ext.crc, ext.verified))
            self._free(ext)

    def _free(self, ext: Extent) -> None:
        self._alloc.free(ext.offset - HEADER_BYTES, ext.size)

    def _spill(self, evicted) -> None:
        # Outside the lock: a disk write must not stall the other threads' reads. A block not
        # verified since its commit is checked here, on the copy that would be written.
        if self.spill is None:
            return
        for key, data, crc, verified in evicted:
            if verified or checksum(data) == crc:
                self.spill.put(key, data, crc)
            else:
                with self._lock:
                    self.corrupt_blocks += 1
                    self.commit_mismatches += 1

    # ---- pins: a block's extent is not reused while a reader holds it --------------------
    def pin(self, key: BlockKey) -> Extent | None:
        """The stored block, pinned (unverified: the reader checks it); a block only on disk is
        brought back into memory first. None: a miss (or no room to bring it back)."""
        with self._lock:
            ext = self._pin_locked(key)
        if ext is not None or self.spill is None:
            return ext
        found = self.spill.get(key)       # verified by the disk tier
        if found is None:
            return None
        data, crc = found
        with self._lock:
            ext = self._pin_locked(key)   # another reader brought it back meanwhile
            if ext is not None:
                return ext
            slot, evicted = self._allocate(len(data))
            if slot is not None:
                self._reserved += slot.size
                slot.pins = 1             # the reservation's own: nobody else sees it yet
                self._pins += 1
        self._spill(evicted)
        if slot is None:
            return None
        copy_into(self.view(slot), data)
        with self._lock:
            if self._commit_locked(key, slot, crc) is PutOutcome.STORED:
                return slot
            slot.pins, self._pins = 0, self._pins - 1   # EXISTS: freed by the commit
            return self._pin_locked(key)

    def _pin_locked(self, key: BlockKey) -> Extent | None:
        ext = self._blocks.get(key)
        if ext is not None:
            self._blocks.move_to_end(key)   # a read is a use
            ext.pins += 1
            self._pins += 1
        return ext

    def unpin(self, ext: Extent) -> None:
        with self._lock:
            ext.pins -= 1
            self._pins -= 1
            if not ext.pins and not ext.stored:   # removed while pinned: its extent is free now
                self._free(ext)

    def verify(self, key: BlockKey, ext: Extent) -> bool:
        """Check a pinned block's bytes in place; a corrupt one is removed (and counted)."""
        ok = checksum(self.view(ext)) == ext.crc
        with self._lock:
            if ok:
                self._mark_verified_locked(ext)
            else:
                self._drop_corrupt_locked(key, ext)
        return ok

    def _drop_corrupt_locked(self, key: BlockKey, ext: Extent) -> None:
        # Bit rot, a bug, or a writer's checksum that never matched: never hand it out again.
        if self._blocks.get(key) is ext:
            if not ext.verified:
                self.commit_mismatches += 1
            self._remove_locked(key)
            self.corrupt_blocks += 1

    # ---- the Backend protocol ------------------------------------------------------------
    def put(self, key: BlockKey, data, crc: int) -> PutOutcome:
        slot = self.reserve(key, len(data))
        if not isinstance(slot, Extent):
            return slot
        copy_into(self.view(slot), data)
        return self.commit(key, slot, crc)

    def get(self, key: BlockKey) -> tuple[bytes, int] | None:
        ext = self.pin(key)
        if ext is None:
            return None
        try:
            data = bytes(self.view(ext))
        finally:
            self.unpin(ext)
        ok = checksum(data) == ext.crc
        with self._lock:
            if ok:
                self._mark_verified_locked(ext)
            else:
                self._drop_corrupt_locked(key, ext)
        return (data, ext.crc) if ok else None

    def touch(self, keys: list[BlockKey]) -> None:
        on_disk = []
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                else:
                    on_disk.append(key)
        if self.spill is not None:
            for key in on_disk:
                self.spill.touch(key)

    def contains(self, keys: list[BlockKey]) -> int:
        """A prefix may lie partly in memory and partly on disk (older blocks spill first)."""
        n = 0
        for key in keys:
            with self._lock:
                here = key in self._blocks
            if not here and (self.spill is None or not self.spill.contains([key])):
                break
            n += 1
        return n

    def flush(self, ns_id: bytes | None) -> int:
        with self._lock:
            doomed = [k for k in self._blocks if ns_id is None or k[0] == ns_id]
            for k in doomed:
                self._remove_locked(k)
        removed = len(doomed)
        if self.spill is not None:
            removed += self.spill.flush(ns_id)
        return removed

    def _remove_locked(self, key: BlockKey) -> None:
        ext = self._unlink_locked(key)
        if not ext.pins:
            self._free(ext)

    def _unlink_locked(self, key: BlockKey) -> Extent:
        """Out of the LRU and the accounting; its extent is the caller's to free."""
        ext = self._blocks.pop(key)
        ext.stored = False
        self._bytes -= ext.size
        if not ext.verified:
            self._unverified -= ext.size
        return ext

    def corrupt_for_test(self, key: BlockKey) -> bool:
        """Flip one stored byte in place (what bit rot, or a client writing where it must not,
        would do); tests only."""
        with self._lock:
            ext = self._blocks.get(key)
            if ext is None:
                return False
            self.arena.mm[ext.offset + ext.size // 2] ^= 0xFF
            return True

    def keys(self) -> list[BlockKey]:
        """In LRU order, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def free_extents(self) -> list[tuple[int, int]]:
        with self._lock:
            return self._alloc.free_extents()

    def stats(self) -> BackendStats:
        with self._lock:
            s = BackendStats(self.name, blocks=len(self._blocks), bytes=self._bytes,
                             capacity_bytes=self.capacity_bytes, evictions=self.evictions,
                             corrupt_blocks=self.corrupt_blocks,
                             extra={"pins": self._pins, "reserved_bytes": self._reserved,
                                    "free_bytes": self._alloc.free_bytes, "unverified_bytes": self._unverified,
                                    "commit_mismatches": self.commit_mismatches})
        if self.spill is not None:
            d = self.spill.stats()
            s.disk_blocks, s.disk_bytes, s.disk_capacity_bytes = d.blocks, d.bytes, d.capacity_bytes
            s.corrupt_blocks += d.corrupt_blocks
        return s

    def close(self) -> None:
        """A graceful stop writes what is in memory to the disk tier (least recent first, so
        the disk's LRU order continues); after kill -9 only what was spilled is there."""
        with self._lock:
            blocks = [(k, bytes(self.view(e)), e.crc, e.verified) for k, e in self._blocks.items()] if self.spill else []
            self._blocks.clear()
            self._bytes = self._unverified = 0
        self._spill(blocks)
        self.arena.close()
