"""The disk spill tier: blocks evicted from host memory, one file each under
DIR/<namespace id>/<block hash>.kvb, bounded by a hard byte capacity (LRU by last use, kept in
the files' mtimes so a restarted kvstore finds the same order).

Writes are atomic (a temporary file in the same folder, then rename), so a reader sees a whole
file or none; a file that is short, foreign or fails its checksum is a miss and is deleted."""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

from services.kvstore import record
from services.kvstore.backend import BackendStats, BlockKey, PutOutcome

log = logging.getLogger("meshllm.kvstore.disk")
SUFFIX = ".kvb"


class DiskTier:
    def __init__(self, directory: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("disk capacity must be positive")
        self.dir = os.path.abspath(directory)
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[BlockKey, int] = OrderedDict()   # key -> file bytes, LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0
        self.corrupt_blocks = 0
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._scan()

    def _path(self, key: BlockKey) -> str:
        return os.path.join(self.dir, key[0].hex(), key[1].hex() + SUFFIX)

    def _scan(self) -> None:
        """Index what an earlier kvstore left: oldest use first; leftovers of interrupted writes
        are removed; a smaller capacity than last time evicts down to it."""
        found = []
        for ns_name in os.listdir(self.dir):
            ns_dir = os.path.join(self.dir, ns_name)
            try:
                ns_id = bytes.fromhex(ns_name)
                names = os.listdir(ns_dir)
            except (ValueError, NotADirectoryError):
                continue
            for name in names:
                path = os.path.join(ns_dir, name)
                if not name.endswith(SUFFIX):
                    if ".tmp-" in name:
                        _unlink(path)
                    continue
                try:
                    block_hash = bytes.fromhex(name[:-len(SUFFIX)])
                    st = os.stat(path)
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, (ns_id, block_hash), st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        with self._lock:
            for key in self._evict_for(0):
                _unlink(self._path(key))
        if found:
            log.info("disk tier %s: %d blocks, %d bytes found", self.dir, len(self._files), self._bytes)

    def _evict_for(self, size: int) -> list[BlockKey]:
        doomed = []
        while self._files and self._bytes + size > self.capacity_bytes:
            key, old = self._files.popitem(last=False)
            self._bytes -= old
            self.evictions += 1
            doomed.append(key)
        return doomed

    def put(self, key: BlockKey, data: bytes, crc: int) -> PutOutcome:
        size = record.record_size(key[1], len(data))
        if size > self.capacity_bytes:
            return PutOutcome.TOO_LARGE
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                return PutOutcome.EXISTS
            doomed = self._evict_for(size)
            self._files[key] = size       # reserved now, so concurrent puts respect the bound
            self._bytes += size
        for old in doomed:
            _unlink(self._path(old))
        path = self._path(key)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(record.encode(key[0], key[1], data, crc))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk tier: cannot write a block (%s)", exc.strerror or exc)
            _unlink(tmp)
            self._forget(key)
            return PutOutcome.FAILED
        return PutOutcome.STORED

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self._bytes -= size

    def get(self, key: BlockKey) -> tuple[bytes, int] | None:
        with self._lock:
            if key not in self._files:
                return None
            self._files.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            self._forget(key)
            return None
        found = record.decode(raw, key[0], key[1])
        if found is None:   # short, foreign or corrupt: a miss, and gone
            with self._lock:
                self.corrupt_blocks += 1
            log.warning("disk tier: a corrupt block file was removed (%d bytes)", len(raw))
            self._forget(key)
            _unlink(path)
            return None
        try:
            os.utime(path)   # the LRU order survives a restart
        except OSError:
            pass
        return found

    def touch(self, key: BlockKey) -> bool:
        """Mark a block recently used; False if it is not here."""
        with self._lock:
            if key not in self._files:
                return False
            self._files.move_to_end(key)
        try:
            os.utime(self._path(key))
        except OSError:
            pass
        return True

    def contains(self, keys: list[BlockKey]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._files:
                    break
                n += 1
        return n

    def flush(self, ns_id: bytes | None) -> int:
        with self._lock:
            doomed = [k for k in self._files if ns_id is None or k[0] == ns_id]
            for k in doomed:
                self._bytes -= self._files.pop(k)
        for k in doomed:
            _unlink(self._path(k))
        return len(doomed)

    def path_for_test(self, key: BlockKey) -> str:
        return self._path(key)

    def stats(self) -> BackendStats:
        with self._lock:
            return BackendStats("disk", blocks=len(self._files), bytes=self._bytes,
                                capacity_bytes=self.capacity_bytes, evictions=self.evictions,
                                corrupt_blocks=self.corrupt_blocks)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
