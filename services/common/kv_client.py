"""The kvstore client the engines use (docs/kvstore.md): Lookup, Put and Get of whole KV blocks
over the fastest data plane it can reach (the kvstore's same-host shared-memory window, else
gRPC bytes), and never an exception into the caller's hot path.

    kv = KvClient("127.0.0.1:50070", credentials=tls.channel_credentials())
    n = kv.lookup(ns, chain)                    # longest stored prefix of a hash chain
    kv.put(ns, [(block_hash, buf), ...])        # buf: any C-contiguous bytes-like object
    found = kv.get_into(ns, hashes, [dst, ...]) # copies into writable buffers; [True/False]

Every call has a deadline; a kvstore that is down, slow, restarted or full gives misses and
dropped saves. A lost kvstore is logged once (and again when it is back), and calls made while
it is lost return at once (a miss) until the next retry time: no per-call timeouts pile up.
Thread-safe; one shared-memory window per client, used by one transfer at a time."""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.common import kv_blocks
from services.common.grpc_server import GRPC_OPTIONS
from services.common.kv_blocks import checksum, copy_and_checksum, encode_put_request, kv_pb2
from services.common.metrics import PREFIX, RPC_LATENCY_BUCKETS

import services  # noqa: F401,E402
from meshllm.v1 import kv_pb2_grpc  # noqa: E402

log = logging.getLogger("meshllm.kv_client")

HITS = Counter(PREFIX + "kv_tier_hit_blocks_total", "blocks loaded from a KV tier", ["tier"])
MISSES = Counter(PREFIX + "kv_tier_miss_blocks_total", "blocks asked for and not loaded (absent, corrupt, "
                 "or the tier unreachable)", ["tier"])
SAVED = Counter(PREFIX + "kv_tier_saved_blocks_total", "blocks saved to a KV tier", ["tier"])
DROPPED = Counter(PREFIX + "kv_tier_dropped_blocks_total", "blocks whose save was refused or dropped", ["tier"])
BYTES = Counter(PREFIX + "kv_tier_bytes_total", "bytes moved to (save) and from (load) a KV tier",
                ["tier", "direction"])
SECONDS = Histogram(PREFIX + "kv_tier_transfer_seconds", "one load or save call, end to end",
                    ["tier", "direction"], buckets=RPC_LATENCY_BUCKETS)
GBPS = Gauge(PREFIX + "kv_tier_last_gbps", "GB/s of the last load or save call", ["tier", "direction"])
AVAILABLE = Gauge(PREFIX + "kv_tier_available", "1 while the tier answers, 0 once it is lost", ["tier"])
TIER = "kvstore"

Block = tuple[bytes, object]   # (block hash, bytes-like of namespace.block_bytes bytes)


def _nbytes(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _Window:
    """This client's leased window of the kvstore's arena, mapped into our address space."""

    def __init__(self, resp: "kv_pb2.OpenArenaResponse") -> None:
        fd = os.open(resp.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if resp.window_offset + resp.window_bytes > size:
                raise OSError("the arena is smaller than the window")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # The path names a pid's fd: on another host or after pid reuse it is someone else's.
        if self._mm[:len(resp.nonce)] != resp.nonce:
            self._mm.close()
            raise OSError("the mapping is not the kvstore's arena")
        self.lease = kv_pb2.ShmWindow(lease_id=resp.lease_id)
        self.view = memoryview(self._mm)[resp.window_offset:resp.window_offset + resp.window_bytes]
        self.size = resp.window_bytes
        self.lock = threading.Lock()

    def close(self) -> None:
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            pass


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


class KvClient:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, *,
                 use_shm: bool = True, window_bytes: int = 64 << 20, timeout_s: float = 1.0,
                 lookup_timeout_s: float = 0.25, min_gbps: float = 0.2, retry_after_s: float = 0.5,
                 max_retry_after_s: float = 5.0, copy_threads: int | None = None) -> None:
        self.address = address
        self.use_shm = use_shm
        self.window_bytes = window_bytes
        self.timeout_s = timeout_s
        self.lookup_timeout_s = lookup_timeout_s
        self.min_gbps = min_gbps
        self._retry_after_s = retry_after_s
        self._max_retry_after_s = max_retry_after_s
        opts = GRPC_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                               ("grpc.max_reconnect_backoff_ms", 1000)]
        self._channel = (grpc.secure_channel(address, credentials, options=opts) if credentials is not None
                         else grpc.insecure_channel(address, options=opts))
        self._stub = kv_pb2_grpc.KvStoreStub(self._channel)
        # Put with a request serialized by hand (kv_blocks.encode_put_request): protobuf's own
        # serializer is the slowest step of gRPC bytes.
        self._put_raw = self._channel.unary_unary("/meshllm.v1.KvStore/Put", request_serializer=None,
                                                  response_deserializer=kv_pb2.PutResponse.FromString)
        self._lock = threading.Lock()
        self._lost_since: float | None = None
        self._retry_at = 0.0
        self._backoff = retry_after_s
        self._window: _Window | None = None
        self._window_retry_at = 0.0
        self._refusals: set[str] = set()   # reasons already logged (bounded)
        # The blocks of one call are copied and checksummed on several threads (numpy's copy and
        # zlib's crc32 release the GIL).
        self._copies = ThreadPoolExecutor(copy_threads or min(8, os.cpu_count() or 1),
                                          thread_name_prefix="kv-client-copy")
        AVAILABLE.labels(TIER).set(1)

    # ---- availability ------------------------------------------------------------------
    def _skip(self) -> bool:
        """While the kvstore is lost, calls are misses at once until the next retry time."""
        return self._lost_since is not None and time.monotonic() < self._retry_at

    def _lost(self, exc: grpc.RpcError) -> None:
        with self._lock:
            first = self._lost_since is None
            now = time.monotonic()
            if first:
                self._lost_since, self._backoff = now, self._retry_after_s
            else:
                self._backoff = min(self._backoff * 2, self._max_retry_after_s)
            self._retry_at = now + self._backoff
            self._drop_window_locked()
        if first:
            AVAILABLE.labels(TIER).set(0)
            log.warning("kvstore %s lost (%s): loads are misses and saves are dropped until it answers",
                        self.address, exc.code().name if hasattr(exc, "code") else type(exc).__name__)

    def _ok(self) -> None:
        if self._lost_since is None:
            return
        with self._lock:
            since, self._lost_since = self._lost_since, None
            self._window_retry_at = 0.0   # a restarted store has a new arena: map it at once
        if since is not None:
            AVAILABLE.labels(TIER).set(1)
            log.info("kvstore %s answers again after %.1fs", self.address, time.monotonic() - since)

    @property
    def available(self) -> bool:
        return self._lost_since is None

    def _call(self, method, request, timeout: float):
        """The response, or None (the failure is accounted). A refused request is the caller's
        bug: logged, never raised. A lease the store forgot drops our window."""
        try:
            resp = method(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                self._ok()
                with self._lock:
                    self._drop_window_locked()
            elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.RESOURCE_EXHAUSTED):
                self._ok()   # the store answered: our request is wrong (a bug), logged once per reason
                details = (exc.details() if hasattr(exc, "details") else str(exc)) or code.name
                if details not in self._refusals and len(self._refusals) < 32:
                    self._refusals.add(details)
                    log.error("kvstore refused a call (%s): %s", code.name, details[:200])
            else:
                self._lost(exc)
            return None
        self._ok()
        return resp

    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / (self.min_gbps * 1e9)

    # ---- the shared-memory window ------------------------------------------------------
    def _drop_window_locked(self) -> None:
        # Detached, not closed: another thread may be copying through it; the mapping goes
        # with its last reference.
        if self._window is not None:
            self._window = None
            self._window_retry_at = time.monotonic() + 1.0

    def _get_window(self) -> _Window | None:
        if not self.use_shm:
            return None
        with self._lock:
            if self._window is not None or time.monotonic() < self._window_retry_at:
                return self._window
            self._window_retry_at = time.monotonic() + 5.0   # failures retry this often
        resp = self._call(self._stub.OpenArena, kv_pb2.OpenArenaRequest(window_bytes=self.window_bytes),
                          self.lookup_timeout_s)
        if resp is None or not resp.path:
            return None   # unreachable, no arena there, or none free: gRPC bytes
        try:
            if resp.boot_id != _boot_id():
                raise OSError("the kvstore runs on another host")
            window = _Window(resp)
        except OSError as exc:
            # Another host or container (its /proc is not ours): it will not change, so give the
            # lease back and ask again only once a minute.
            self._close_lease(resp.lease_id)
            with self._lock:
                self._window_retry_at = time.monotonic() + 60.0
            log.info("kvstore %s shared memory not usable here (%s): gRPC bytes", self.address, exc)
            return None
        with self._lock:
            if self._window is None:
                self._window = window
                log.info("kvstore %s: shared-memory window of %d MiB", self.address, window.size >> 20)
                return window
        self._close_lease(resp.lease_id)   # another thread mapped one meanwhile
        window.close()
        return self._window

    def _close_lease(self, lease_id: int) -> None:
        try:
            self._stub.CloseArena(kv_pb2.CloseArenaRequest(window=kv_pb2.ShmWindow(lease_id=lease_id)),
                                  timeout=self.lookup_timeout_s)
        except grpc.RpcError:
            pass   # the lease expires on its own

    @property
    def transport(self) -> str:
        """What the next transfer would use: "shm" or "grpc"."""
        return "shm" if self._get_window() is not None else "grpc"

    # ---- the API ----------------------------------------------------------------------
    def lookup(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes]) -> int:
        """How many blocks of the chain, from the first, the kvstore holds (0 when unreachable)."""
        if not block_hashes or self._skip():
            return 0
        resp = self._call(self._stub.Lookup, kv_pb2.LookupRequest(
            namespace=ns, block_hashes=list(block_hashes[:kv_blocks.MAX_LOOKUP_HASHES])), self.lookup_timeout_s)
        return resp.num_found if resp is not None else 0

    def put(self, ns: "kv_pb2.KvNamespace", blocks: Sequence[Block]) -> int:
        """Save blocks; the number the kvstore now holds (stored or already there). Blocks it
        refuses or cannot take are dropped and counted."""
        if not blocks:
            return 0
        if self._skip():
            DROPPED.labels(TIER).inc(len(blocks))
            return 0
        start = time.perf_counter()
        views = [(h, _nbytes(buf)) for h, buf in blocks]
        window = self._get_window()
        per_call = (window.size if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES) // max(1, ns.block_bytes)
        kept = 0
        for i in range(0, len(views), max(1, min(per_call, kv_blocks.MAX_BLOCKS_PER_CALL))):
            chunk = views[i:i + max(1, min(per_call, kv_blocks.MAX_BLOCKS_PER_CALL))]
            kept += self._put_chunk(ns, chunk, window)
            if self._skip():
                break
        DROPPED.labels(TIER).inc(len(blocks) - kept)
        SAVED.labels(TIER).inc(kept)
        self._timed("save", kept * ns.block_bytes, start)
        return kept

    def _put_chunk(self, ns, chunk, window: _Window | None) -> int:
        nbytes = sum(len(v) for _, v in chunk)
        if window is not None and nbytes <= window.size:
            with window.lock:
                if self._window is window:   # not dropped meanwhile
                    offsets = [0]
                    for _, v in chunk[:-1]:
                        offsets.append(offsets[-1] + len(v))
                    crcs = self._map(lambda j: copy_and_checksum(
                        window.view[offsets[j]:offsets[j] + len(chunk[j][1])], chunk[j][1]), len(chunk))
                    metas = [kv_pb2.KvBlock(meta=kv_pb2.KvBlockMeta(block_hash=h, size=len(v), checksum=crc, offset=off))
                             for (h, v), crc, off in zip(chunk, crcs, offsets)]
                    resp = self._call(self._stub.Put, kv_pb2.PutRequest(namespace=ns, blocks=metas,
                                                                        window=window.lease), self._deadline(nbytes))
                    if resp is not None or not self.available:
                        return _kept(resp)
        crcs = self._map(lambda j: checksum(chunk[j][1]), len(chunk))
        raw = encode_put_request(ns, [(kv_pb2.KvBlockMeta(block_hash=h, size=len(v), checksum=crc), v)
                                      for (h, v), crc in zip(chunk, crcs)])
        return _kept(self._call(self._put_raw, raw, self._deadline(nbytes)))

    def get(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Each block's bytes, or None for a miss."""
        out: list[bytes | None] = [None] * len(block_hashes)
        dests = [bytearray(ns.block_bytes) for _ in block_hashes]
        for i, ok in enumerate(self.get_into(ns, block_hashes, dests)):
            if ok:
                out[i] = bytes(dests[i])
        return out

    def get_into(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes], dests: Sequence[object]) -> list[bool]:
        """Copy each found block into its writable buffer (namespace.block_bytes bytes, e.g. a
        pinned host tensor viewed as uint8); True where it was loaded and verified."""
        if len(dests) != len(block_hashes):
            raise ValueError("get_into needs one destination per block hash")
        found = [False] * len(block_hashes)
        if not block_hashes:
            return found
        if self._skip():
            MISSES.labels(TIER).inc(len(block_hashes))
            return found
        start = time.perf_counter()
        window = self._get_window()
        room = window.size if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES
        step = max(1, min(room // max(1, ns.block_bytes), kv_blocks.MAX_BLOCKS_PER_CALL))
        for i in range(0, len(block_hashes), step):
            self._get_chunk(ns, block_hashes[i:i + step], dests[i:i + step], found, i, window)
            if self._skip():
                break
        hits = sum(found)
        HITS.labels(TIER).inc(hits)
        MISSES.labels(TIER).inc(len(found) - hits)
        self._timed("load", hits * ns.block_bytes, start)
        return found

    def _get_chunk(self, ns, hashes, dests, found: list[bool], base: int, window: _Window | None) -> None:
        nbytes = len(hashes) * ns.block_bytes
        if window is not None and nbytes <= window.size:
            with window.lock:
                if self._window is window:
                    resp = self._call(self._stub.Get, kv_pb2.GetRequest(namespace=ns, block_hashes=list(hashes),
                                                                        window=window.lease), self._deadline(nbytes))
                    if resp is not None:
                        def fill(j: int) -> bool:
                            m = resp.blocks[j].meta
                            return bool(m.block_hash) and m.offset + m.size <= window.size and _fill(
                                dests[j], window.view[m.offset:m.offset + m.size], m, ns)
                        for j, ok in enumerate(self._map(fill, len(resp.blocks))):
                            found[base + j] = ok
                        return
                    if not self.available:
                        return
        resp = self._call(self._stub.Get, kv_pb2.GetRequest(namespace=ns, block_hashes=list(hashes)),
                          self._deadline(nbytes))
        if resp is not None:
            def fill_bytes(j: int) -> bool:
                b = resp.blocks[j]
                return bool(b.meta.block_hash) and _fill(dests[j], b.data, b.meta, ns)
            for j, ok in enumerate(self._map(fill_bytes, len(resp.blocks))):
                found[base + j] = ok

    def _map(self, fn, n: int) -> list:
        return [fn(0)] if n == 1 else list(self._copies.map(fn, range(n)))

    def _timed(self, direction: str, nbytes: int, start: float) -> None:
        dt = time.perf_counter() - start
        SECONDS.labels(TIER, direction).observe(dt)
        if nbytes:
            BYTES.labels(TIER, direction).inc(nbytes)
            GBPS.labels(TIER, direction).set(nbytes / dt / 1e9 if dt > 0 else 0.0)

    def stats(self) -> "kv_pb2.StatsResponse | None":
        return None if self._skip() else self._call(self._stub.Stats, kv_pb2.StatsRequest(), self.timeout_s)

    def flush(self, ns: "kv_pb2.KvNamespace | None" = None) -> int | None:
        """Remove a namespace's blocks (None: all of them); the number removed, None if unreachable."""
        req = kv_pb2.FlushRequest(namespace=ns) if ns is not None else kv_pb2.FlushRequest(all_namespaces=True)
        resp = self._call(self._stub.Flush, req, self.timeout_s * 5)
        return resp.blocks_removed if resp is not None else None

    def close(self) -> None:
        with self._lock:
            window, self._window = self._window, None
        if window is not None:
            self._close_lease(window.lease.lease_id)
            window.close()
        self._channel.close()
        self._copies.shutdown(wait=False)


def _kept(resp: "kv_pb2.PutResponse | None") -> int:
    if resp is None:
        return 0
    return sum(1 for s in resp.statuses if s in (kv_pb2.KV_PUT_STATUS_STORED, kv_pb2.KV_PUT_STATUS_EXISTS))


def _fill(dest, src, meta: "kv_pb2.KvBlockMeta", ns: "kv_pb2.KvNamespace") -> bool:
    """Copy a block into its destination and verify what landed there (the end-to-end check)."""
    out = _nbytes(dest)
    if meta.size != ns.block_bytes or len(src) != ns.block_bytes or len(out) != ns.block_bytes:
        return False
    return copy_and_checksum(out, src) == meta.checksum
