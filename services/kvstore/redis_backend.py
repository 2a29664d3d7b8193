"""The Redis backend (`--backend redis://HOST:PORT[/DB]`): every block is one Redis string
(record.py's header + bytes) under meshllm:kv:<namespace id>:<block hash>, so many kvstores on
many hosts share one tier. The kvstore keeps nothing itself: capacity and LRU eviction are the
Redis server's (run it with --maxmemory and --maxmemory-policy allkeys-lru); a block larger
than --capacity-gb is refused here, and one Redis cannot hold (OOM) is a failed put.

An unreachable Redis is a miss / a failed put, logged once until it answers again."""
from __future__ import annotations

import logging
import threading

import redis

from services.kvstore import record
from services.kvstore.backend import BackendStats, BlockKey, PutOutcome

log = logging.getLogger("meshllm.kvstore.redis")
PREFIX = b"meshllm:kv:"


def _key(key: BlockKey) -> bytes:
    return PREFIX + key[0].hex().encode() + b":" + key[1].hex().encode()


class RedisBackend:
    name = "redis"
    arena = None   # nothing kept here: no zero copy (the same-host plane is a window)

    def __init__(self, url: str, capacity_bytes: int, timeout_s: float = 2.0) -> None:
        self.url = url
        self.capacity_bytes = capacity_bytes
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           health_check_interval=30)
        self._lock = threading.Lock()
        self._lost = False
        self.corrupt_blocks = 0

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            first, self._lost = not self._lost, True
        if first:
            log.warning("redis backend %s unreachable (%s): misses until it answers", _safe(self.url),
                        type(exc).__name__)

    def _ok(self) -> None:
        if self._lost:
            with self._lock:
                was, self._lost = self._lost, False
            if was:
                log.info("redis backend %s answers again", _safe(self.url))

    def put(self, key: BlockKey, data: bytes, crc: int) -> PutOutcome:
        if record.record_size(key[1], len(data)) > self.capacity_bytes:
            return PutOutcome.TOO_LARGE
        rkey = _key(key)
        try:
            stored = self._redis.set(rkey, record.encode(key[0], key[1], data, crc), nx=True)
            if not stored:
                self._redis.touch(rkey)   # refresh its LRU clock
        except redis.exceptions.ResponseError as exc:   # OOM with a noeviction policy, ...
            self._ok()
            log.info("redis refused a block: %s", str(exc)[:80])
            return PutOutcome.FAILED
        except redis.exceptions.RedisError as exc:
            self._failed(exc)
            return PutOutcome.FAILED
        self._ok()
        return PutOutcome.STORED if stored else PutOutcome.EXISTS

    def get(self, key: BlockKey) -> tuple[bytes, int] | None:
        rkey = _key(key)
        try:
            raw = self._redis.get(rkey)
        except redis.exceptions.RedisError as exc:
            self._failed(exc)
            return None
        self._ok()
        if raw is None:
            return None
        found = record.decode(raw, key[0], key[1])
        if found is None:
            with self._lock:
                self.corrupt_blocks += 1
            log.warning("redis backend: a corrupt block was removed (%d bytes)", len(raw))
            try:
                self._redis.unlink(rkey)
            except redis.exceptions.RedisError as exc:
                self._failed(exc)
        return found

    def touch(self, keys: list[BlockKey]) -> None:
        """Redis's LRU clock ticks once a second: the order within one call is not kept there."""
        try:
            self._redis.touch(*[_key(k) for k in keys])
        except redis.exceptions.RedisError as exc:
            self._failed(exc)

    def contains(self, keys: list[BlockKey]) -> int:
        if not keys:
            return 0
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(_key(key))
            present = pipe.execute()
        except redis.exceptions.RedisError as exc:
            self._failed(exc)
            return 0
        self._ok()
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n

    def flush(self, ns_id: bytes | None) -> int:
        pattern = PREFIX + (ns_id.hex().encode() + b":*" if ns_id is not None else b"*")
        removed = 0
        try:
            batch = []
            for rkey in self._redis.scan_iter(match=pattern, count=1000):
                batch.append(rkey)
                if len(batch) >= 1000:
                    removed += self._redis.unlink(*batch)
                    batch = []
            if batch:
                removed += self._redis.unlink(*batch)
        except redis.exceptions.RedisError as exc:
            self._failed(exc)
        return removed

    def stats(self) -> BackendStats:
        s = BackendStats("redis", capacity_bytes=self.capacity_bytes, corrupt_blocks=self.corrupt_blocks)
        try:
            mem = self._redis.info("memory")
            s.bytes = int(mem.get("used_memory", 0))
            if int(mem.get("maxmemory", 0)):
                s.capacity_bytes = int(mem["maxmemory"])
            s.blocks = int(self._redis.dbsize())
            s.evictions = int(self._redis.info("stats").get("evicted_keys", 0))
        except redis.exceptions.RedisError as exc:
            self._failed(exc)
        return s

    def close(self) -> None:
        self._redis.close()


def _safe(url: str) -> str:
    """The URL without a password (redis://:secret@host -> redis://host)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"
