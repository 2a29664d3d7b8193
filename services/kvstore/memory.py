"""The host-memory tier: an LRU of blocks bounded by a hard byte capacity, with an optional
spill tier (disk.py) that receives what is evicted and is read through on a miss."""
from __future__ import annotations

import threading
from collections import OrderedDict

from services.common.kv_blocks import checksum
from services.kvstore.backend import BackendStats, BlockKey, PutOutcome


class MemoryBackend:
    """OrderedDict order is the LRU order: the first entry is the least recently used."""

    def __init__(self, capacity_bytes: int, spill=None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.spill = spill                   # a DiskTier, or None
        self.name = "memory+disk" if spill is not None else "memory"
        self._blocks: OrderedDict[BlockKey, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self.corrupt_blocks = 0

    def put(self, key: BlockKey, data: bytes, crc: int) -> PutOutcome:
        if len(data) > self.capacity_bytes:
            return PutOutcome.TOO_LARGE
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return PutOutcome.EXISTS
        if self.spill is not None and self.spill.touch(key):
            return PutOutcome.EXISTS      # a get brings it back to memory when it is wanted
        with self._lock:
            if key in self._blocks:
                return PutOutcome.EXISTS
            evicted = self._make_room(len(data))
            self._blocks[key] = (data, crc)
            self._bytes += len(data)
        self._spill(evicted)
        return PutOutcome.STORED

    def _make_room(self, size: int) -> list[tuple[BlockKey, bytes, int]]:
        evicted = []
        while self._bytes + size > self.capacity_bytes:
            old_key, (old, old_crc) = self._blocks.popitem(last=False)
            self._bytes -= len(old)
            self.evictions += 1
            evicted.append((old_key, old, old_crc))
        return evicted

    def _spill(self, evicted) -> None:
        # Outside the lock: a disk write must not stall the gets of other threads.
        if self.spill is not None:
            for key, data, crc in evicted:
                self.spill.put(key, data, crc)

    def get(self, key: BlockKey) -> tuple[bytes, int] | None:
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None:
                self._blocks.move_to_end(key)
        if entry is not None:
            data, crc = entry
            if checksum(data) == crc:
                return entry
            with self._lock:   # bit rot or a bug: never hand it out, never keep it
                if self._blocks.get(key) is entry:
                    del self._blocks[key]
                    self._bytes -= len(data)
                    self.corrupt_blocks += 1
            return None
        if self.spill is None:
            return None
        found = self.spill.get(key)       # read through: a hit comes back into memory
        if found is not None and len(found[0]) <= self.capacity_bytes:
            with self._lock:
                if key not in self._blocks:
                    evicted = self._make_room(len(found[0]))
                    self._blocks[key] = found
                    self._bytes += len(found[0])
                else:
                    evicted = []
            self._spill(evicted)
        return found

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
                self._bytes -= len(self._blocks.pop(k)[0])
        removed = len(doomed)
        if self.spill is not None:
            removed += self.spill.flush(ns_id)
        return removed

    def corrupt_for_test(self, key: BlockKey) -> bool:
        """Flip one stored byte in place of the block (what bit rot would do); tests only."""
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return False
            data = bytearray(entry[0])
            data[len(data) // 2] ^= 0xFF
            self._blocks[key] = (bytes(data), entry[1])
            return True

    def keys(self) -> list[BlockKey]:
        """In LRU order, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def stats(self) -> BackendStats:
        with self._lock:
            s = BackendStats(self.name, blocks=len(self._blocks), bytes=self._bytes,
                             capacity_bytes=self.capacity_bytes, evictions=self.evictions,
                             corrupt_blocks=self.corrupt_blocks)
        if self.spill is not None:
            d = self.spill.stats()
            s.disk_blocks, s.disk_bytes, s.disk_capacity_bytes = d.blocks, d.bytes, d.capacity_bytes
            s.corrupt_blocks += d.corrupt_blocks
        return s

    def close(self) -> None:
        """A graceful stop writes what is in memory to the disk tier (least recent first, so
        the disk's LRU order continues); after kill -9 only what was spilled is there."""
        with self._lock:
            blocks = [(k, d, c) for k, (d, c) in self._blocks.items()]
            self._blocks.clear()
            self._bytes = 0
        self._spill(blocks)
