"""The kvstore client the engines use (docs/kvstore.md): Lookup, Put and Get of whole KV blocks
over the fastest data plane it can reach, and never an exception into the caller's hot path.

    kv = KvClient("127.0.0.1:50070", credentials=tls.channel_credentials())
    n = kv.lookup(ns, chain)                    # longest stored prefix of a hash chain
    kv.put(ns, [(block_hash, buf), ...])        # buf: any C-contiguous bytes-like object
    found = kv.get_into(ns, hashes, [dst, ...]) # copies into writable buffers; [True/False]
    # zero copy (None: no arena mapped here, use put / get_into):
    found = kv.read_zero_copy(ns, hashes, consume)   # consume(start, views): copy them out
    kept = kv.write_zero_copy(ns, hashes, fill)      # fill(start, idx, views): write into them
    kv.set_arena_hooks(on_map, on_unmap)             # e.g. cudaHostRegister the mapping

Planes, fastest first: the memory backend's block memory mapped here (same host: blocks are read
and written in place, zero copy: Pin/Release, Reserve/Commit; kv_shm.py), the same block memory
over NIXL when it cannot be mapped here (another host or container: the same Pin / Reserve, the
bytes moved by NIXL READ / WRITE through a registered staging buffer; kv_nixl.py), a leased
shared-memory window (same host, a backend that keeps nothing itself: Redis), gRPC bytes (any
host). `data_plane` forces one (a forced plane that is not there gives gRPC bytes).

Every call has a deadline; a kvstore that is down, slow, restarted or full gives misses and
dropped saves. A lost kvstore is logged once (and again when it is back), and calls made while
it is lost return at once (a miss) until the next retry time: no per-call timeouts pile up.
Thread-safe: zero-copy transfers of many threads run at once; a window carries one at a time."""
from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.common import kv_blocks
from services.common.grpc_server import GRPC_OPTIONS
from services.common.kv_blocks import checksum, copy_and_checksum, encode_put_request, kv_pb2
from services.common.kv_nixl import DONE, FAILED, NixlPlane, NixlRemote
from services.common.kv_shm import ArenaMapping, Window, boot_id, release_view
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
_COMMITS_IN_FLIGHT = 2   # a save's chunk k-1 and k checksummed and committed while k+1 is filled

Block = tuple[bytes, object]   # (block hash, bytes-like of namespace.block_bytes bytes)
Consume = Callable[[int, list], None]              # consume(start, views): views[i] is block start+i
Fill = Callable[[int, list, list], object]         # fill(start, idx, views): views[k] is block idx[k]
_RESERVED = kv_pb2.KV_PUT_STATUS_RESERVED
_KEPT = (kv_pb2.KV_PUT_STATUS_STORED, kv_pb2.KV_PUT_STATUS_EXISTS)
KEEP_LOST_ARENA_S = 30.0   # a store lost this long: its arena is unmapped (its memory given back)
NIXL_RETRY_S = 10.0        # after a failed NIXL transfer: gRPC bytes this long, then NIXL again
DATA_PLANES = ("auto", "zero_copy", "nixl", "shm", "grpc")


def _nbytes(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class KvClient:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, *,
                 use_shm: bool = True, window_bytes: int = 64 << 20, timeout_s: float = 1.0,
                 lookup_timeout_s: float = 0.25, min_gbps: float = 0.2, retry_after_s: float = 0.5,
                 max_retry_after_s: float = 5.0, copy_threads: int | None = None,
                 chunk_bytes: int = 128 << 20, data_plane: str = "auto", nixl_buffer_bytes: int = 128 << 20) -> None:
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        self.address = address
        # The planes this client may use: "auto" all of them, fastest first; one named, only it
        # (else gRPC bytes); use_shm=False is "grpc".
        self.data_plane = data_plane if use_shm else "grpc"
        self.use_shm = self.data_plane != "grpc"
        self.window_bytes = window_bytes
        self.chunk_bytes = chunk_bytes      # bytes per zero-copy Pin / Reserve call
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
        self._open_lock = threading.Lock()   # one OpenArena (and mapping) at a time
        self._lost_since: float | None = None
        self._retry_at = 0.0
        self._backoff = retry_after_s
        self._window: Window | None = None
        # The store's block memory: mapped here (zero copy) or reached over NIXL; the lease's plane.
        self._arena: ArenaMapping | NixlRemote | None = None
        self._lease_id = 0                   # our lease in self._arena (0: none)
        # NIXL: this client's agent and staging buffer, made when first needed (False: unavailable).
        # Slots hold one chunk each, and at least the largest block.
        self._nixl_slot_bytes = max(kv_blocks.MAX_BLOCK_BYTES, min(chunk_bytes, nixl_buffer_bytes // 2))
        self._nixl_slots = max(1, min(8, nixl_buffer_bytes // self._nixl_slot_bytes))
        self._nixl: NixlPlane | bool | None = None
        self._lease_ttl_s = 0.0
        self._lease_used = 0.0
        self._open_retry_at = 0.0
        self._hooks: tuple[Callable | None, Callable | None] = (None, None)
        self._refusals: set[str] = set()   # reasons already logged (bounded)
        # The blocks of one call are copied and checksummed on several threads (numpy's copy and
        # crc32c release the GIL); a zero-copy write's commits run beside the next chunk's fill.
        self._copies = ThreadPoolExecutor(copy_threads or min(8, os.cpu_count() or 1),
                                          thread_name_prefix="kv-client-copy")
        self._commits = ThreadPoolExecutor(_COMMITS_IN_FLIGHT, thread_name_prefix="kv-client-commit")
        self._rpcs = ThreadPoolExecutor(2, thread_name_prefix="kv-client-rpc")   # reads' pins ahead, releases
        AVAILABLE.labels(TIER).set(1)

    # ---- availability ------------------------------------------------------------------
    def _skip(self) -> bool:
        """While the kvstore is lost, calls are misses at once until the next retry time."""
        return self._lost_since is not None and time.monotonic() < self._retry_at

    def _lost(self, exc: grpc.RpcError) -> None:
        retire = None
        with self._lock:
            first = self._lost_since is None
            now = time.monotonic()
            if first:
                self._lost_since, self._backoff = now, self._retry_after_s
            else:
                self._backoff = min(self._backoff * 2, self._max_retry_after_s)
            self._retry_at = now + self._backoff
            self._drop_window_locked()
            self._lease_id = 0
            if self._arena is not None and now - self._lost_since > KEEP_LOST_ARENA_S:
                retire, self._arena = self._arena, None   # gone for good: give its memory back
        if retire is not None:
            self._retire(retire)
        if first:
            AVAILABLE.labels(TIER).set(0)
            log.warning("kvstore %s lost (%s): loads are misses and saves are dropped until it answers",
                        self.address, exc.code().name if hasattr(exc, "code") else type(exc).__name__)

    def _ok(self) -> None:
        if self._lost_since is None:
            return
        with self._lock:
            since, self._lost_since = self._lost_since, None
            self._open_retry_at = 0.0   # a restarted store has a new arena: map it at once
        if since is not None:
            AVAILABLE.labels(TIER).set(1)
            log.info("kvstore %s answers again after %.1fs", self.address, time.monotonic() - since)

    @property
    def available(self) -> bool:
        return self._lost_since is None

    def _call(self, method, request, timeout: float):
        """The response, or None (the failure is accounted). A refused request is the caller's
        bug: logged, never raised. A lease the store forgot drops our window or lease."""
        try:
            resp = method(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                self._ok()
                with self._lock:
                    self._drop_window_locked()
                    self._lease_id, self._open_retry_at = 0, 0.0   # a new lease at once; same mapping
            elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.RESOURCE_EXHAUSTED):
                self._ok()   # the store answered: our request is wrong (a bug), logged once per reason
                details = (exc.details() if hasattr(exc, "details") else str(exc)) or code.name
                self._log_once(f"kvstore refused a call ({code.name}): {details[:200]}", logging.ERROR)
            else:
                self._lost(exc)
            return None
        self._ok()
        return resp

    def _log_once(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self._refusals and len(self._refusals) < 32:
            self._refusals.add(message)
            log.log(level, "%s", message)

    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / (self.min_gbps * 1e9)

    # ---- shared memory: the zero-copy arena, or a window ----------------------------------
    def _drop_window_locked(self) -> None:
        # Detached, not closed: another thread may be copying through it; the mapping goes
        # with its last reference.
        if self._window is not None:
            self._window = None
            self._open_retry_at = time.monotonic() + 1.0

    def _arena_lease(self, mapped_only: bool = False) -> tuple[ArenaMapping | NixlRemote, int] | None:
        """The store's block memory (mapped here, or over NIXL unless `mapped_only`) and a live
        lease on it, held for one transfer (give it back with _done); None: no such plane here
        (another plane, or none reachable)."""
        if not self.use_shm:
            return None
        for _ in range(2):
            with self._lock:
                if self._leased_locked():
                    if mapped_only and not isinstance(self._arena, ArenaMapping):
                        return None
                    self._lease_used = time.monotonic()
                    self._arena.users += 1
                    return self._arena, self._lease_id
                if self._window is not None or time.monotonic() < self._open_retry_at:
                    return None
            self._open()
        return None

    def _leased_locked(self) -> bool:
        """A mapped arena and a lease on it that is safe to use: one idle for half its life is
        replaced rather than risked (the store ends it after a whole life; the old one ends on
        its own)."""
        return (self._arena is not None and self._lease_id != 0
                and time.monotonic() - self._lease_used < self._lease_ttl_s / 2)

    def _done(self, arena: ArenaMapping) -> None:
        with self._lock:
            arena.users -= 1
            last = arena.retired and not arena.users
        if last:
            self._unmap(arena)

    def _retire(self, arena: ArenaMapping) -> None:
        with self._lock:
            arena.retired = True
            last = not arena.users
        if last:
            self._unmap(arena)

    def _unmap(self, arena: ArenaMapping | NixlRemote) -> None:
        on_unmap = self._hooks[1]
        if on_unmap is not None and isinstance(arena, ArenaMapping):
            try:
                on_unmap(arena.mm)
            except Exception as exc:  # noqa: BLE001 - the caller's hook must not break the client
                log.warning("kvstore arena on_unmap hook failed: %s", exc)
        arena.close()

    def set_arena_hooks(self, on_map: Callable[[mmap.mmap], None] | None,
                        on_unmap: Callable[[mmap.mmap], None] | None) -> None:
        """on_map(mm) runs once for each arena this client maps, before any view of it is handed
        out (at once here for one mapped already); on_unmap(mm) before it is unmapped (the store
        lost for good or replaced by a restarted one, or close()). On whichever thread maps."""
        with self._lock:
            self._hooks = (on_map, on_unmap)
            mapped = self._arena
        if isinstance(mapped, ArenaMapping) and on_map is not None:
            self._run_on_map(on_map, mapped)

    def _run_on_map(self, on_map, arena: ArenaMapping) -> None:
        try:
            on_map(arena.mm)
        except Exception as exc:  # noqa: BLE001 - the views still work, only slower for the caller
            log.warning("kvstore arena on_map hook failed: %s", exc)

    def _open(self) -> None:
        """OpenArena: map the store's block memory (zero copy), else reach it over NIXL, else map
        a window; on failure the next try waits (5 s, a minute when no plane can work here)."""
        with self._open_lock:
            with self._lock:
                if self._leased_locked() or self._window is not None or time.monotonic() < self._open_retry_at:
                    return   # another thread opened (or failed) meanwhile
                self._open_retry_at = time.monotonic() + 5.0
            plane = self.data_plane
            resp = self._call(self._stub.OpenArena, kv_pb2.OpenArenaRequest(
                window_bytes=self.window_bytes, zero_copy=plane != "shm"), self.lookup_timeout_s)
            if resp is None or not resp.lease_id:
                return   # unreachable, no shared memory there, or none free: gRPC bytes
            with self._lock:
                current = self._arena
            mapped, why = None, "no plane of this client's there"
            if resp.zero_copy and plane in ("auto", "zero_copy"):
                try:
                    if resp.boot_id != boot_id():
                        raise OSError("the kvstore runs on another host")
                    if isinstance(current, ArenaMapping) and current.nonce == resp.nonce:
                        mapped = current                      # a new lease, the same arena
                    else:
                        mapped = ArenaMapping(resp)
                except OSError as exc:   # another host or container (its /proc is not ours)
                    why = str(exc)
            if mapped is None and resp.nixl_agent and plane in ("auto", "nixl"):
                mapped, why = self._nixl_remote(resp, current, why)
            if mapped is None and resp.window_bytes and plane in ("auto", "shm"):
                try:
                    if resp.boot_id != boot_id():
                        raise OSError("the kvstore runs on another host")
                    mapped = Window(resp)
                except OSError as exc:
                    why = str(exc)
            if mapped is None:
                # It will not change for this store: give the lease back, ask again once a minute.
                self._close_lease(resp.lease_id)
                with self._lock:
                    self._open_retry_at = time.monotonic() + 60.0
                log.info("kvstore %s shared memory not usable here (%s): gRPC bytes", self.address, why)
                return
            if isinstance(mapped, Window):
                with self._lock:
                    self._window, self._open_retry_at = mapped, 0.0
                    self._arena = None
                log.info("kvstore %s: shared-memory window of %d MiB", self.address, mapped.size >> 20)
                if current is not None:
                    self._retire(current)              # a store of another kind took its place
                return
            if mapped is not current:
                if isinstance(mapped, ArenaMapping):
                    if self._hooks[0] is not None:
                        self._run_on_map(self._hooks[0], mapped)   # before any view of it is handed out
                    log.info("kvstore %s: zero copy, its %d MiB of block memory mapped", self.address,
                             mapped.size >> 20)
                else:
                    log.info("kvstore %s: NIXL to its %d MiB of block memory (agent %s)", self.address,
                             mapped.size >> 20, mapped.name)
            with self._lock:
                if mapped.retired:   # given up meanwhile (the store lost too long): not ours to hand out
                    return
                self._arena, self._lease_id = mapped, resp.lease_id
                self._lease_ttl_s, self._lease_used, self._open_retry_at = resp.lease_ttl_s, time.monotonic(), 0.0
            if current is not None and mapped is not current:
                self._retire(current)                  # the store restarted: its old arena goes

    def _nixl_remote(self, resp: "kv_pb2.OpenArenaResponse", current, why: str) -> tuple[NixlRemote | None, str]:
        """The store's NIXL agent loaded into ours: the one loaded already if the store is the
        same process (same agent name), else its metadata fetched under the new lease."""
        if isinstance(current, NixlRemote) and current.name == resp.nixl_agent:
            return current, ""
        if self._nixl is None:
            try:
                self._nixl = NixlPlane(self._nixl_slot_bytes, self._nixl_slots)
            except Exception as exc:  # noqa: BLE001 - NIXL is one plane among others
                self._nixl = False
                log.warning("kvstore client: NIXL unavailable here (%s): gRPC bytes", exc)
        if self._nixl is False:
            return None, f"{why}; NIXL unavailable here"
        meta = self._call(self._stub.NixlMetadata, kv_pb2.NixlMetadataRequest(
            lease=kv_pb2.ShmWindow(lease_id=resp.lease_id)), self.timeout_s)
        if meta is None or meta.agent_name != resp.nixl_agent or meta.arena_bytes != resp.arena_bytes:
            return None, f"{why}; no usable NIXL metadata"
        try:
            return self._nixl.load(meta), ""
        except Exception as exc:  # noqa: BLE001
            return None, f"{why}; NIXL could not load the kvstore's agent ({type(exc).__name__}: {exc})"

    def _close_lease(self, lease_id: int) -> None:
        try:
            self._stub.CloseArena(kv_pb2.CloseArenaRequest(window=kv_pb2.ShmWindow(lease_id=lease_id)),
                                  timeout=self.lookup_timeout_s)
        except grpc.RpcError:
            pass   # the lease expires on its own

    def _get_window(self) -> Window | None:
        if not self.use_shm:
            return None
        with self._lock:
            if self._window is not None or self._leased_locked():
                return self._window
            if time.monotonic() < self._open_retry_at:
                return None
        self._open()
        return self._window

    @property
    def transport(self) -> str:
        """What the next transfer would use: "arena" (zero copy), "nixl", "shm" (a window) or "grpc"."""
        got = self._arena_lease()
        if got is not None:
            self._done(got[0])
            return "arena" if isinstance(got[0], ArenaMapping) else "nixl"
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
        if all(len(v) == ns.block_bytes for _, v in views):
            def fill(_: int, idx: list[int], slots: list) -> list[int]:
                return self._map(lambda k: copy_and_checksum(slots[k], views[idx[k]][1]), len(idx))
            kept = self._write_arena(ns, [h for h, _ in views], fill)
            if kept is not None:
                return self._saved(ns, len(blocks), kept, start)
        window = self._get_window()
        per_call = (window.size if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES) // max(1, ns.block_bytes)
        step = max(1, min(per_call, kv_blocks.MAX_BLOCKS_PER_CALL))
        kept = 0
        for i in range(0, len(views), step):
            kept += self._put_chunk(ns, views[i:i + step], window)
            if self._skip():
                break
        return self._saved(ns, len(blocks), kept, start)

    def write_zero_copy(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes], fill: Fill) -> int | None:
        """Save blocks by writing them straight into the store's memory: None when no arena is
        mapped here (use put). Otherwise slots are reserved for the blocks the store does not
        hold, `fill(start, idx, views)` writes block `idx[k]` (an index into block_hashes) into
        the writable memoryview `views[k]` (e.g. a GPU->host DMA) and returns once the bytes are
        there; the client checksums the slots and commits them. Chunked (each chunk's commit
        overlaps the next chunk's fill). Returns the blocks the store now holds (stored or
        already there); a fill that raises drops its chunk and the rest. Never raises."""
        if not block_hashes:
            return 0
        if self._skip():
            DROPPED.labels(TIER).inc(len(block_hashes))
            return 0
        start = time.perf_counter()

        def fill_then_checksum(first: int, idx: list[int], slots: list) -> None:
            fill(first, idx, slots)
            return None   # the commit step checksums the slots on the pool

        kept = self._write_arena(ns, list(block_hashes), fill_then_checksum, mapped_only=True)
        return None if kept is None else self._saved(ns, len(block_hashes), kept, start)

    def _saved(self, ns, offered: int, kept: int, start: float) -> int:
        DROPPED.labels(TIER).inc(offered - kept)
        SAVED.labels(TIER).inc(kept)
        self._timed("save", kept * ns.block_bytes, start)
        return kept

    def _step(self, ns, arena=None) -> int:
        """Blocks per Pin / Reserve: a chunk; over NIXL also what one staging slot holds."""
        room = self.chunk_bytes if not isinstance(arena, NixlRemote) else min(self.chunk_bytes, arena.plane.slot_bytes)
        return max(1, min(kv_blocks.MAX_BLOCKS_PER_CALL, room // max(1, ns.block_bytes)))

    def _leased(self, transfer, mapped_only: bool = False):
        """transfer(arena, lease) under a live lease; once more under a new one when the store
        did not know ours (it restarted unnoticed, or the lease ended): then the transfer
        answers _LEASE_REFUSED before it did anything. None: no arena mapped here (or reached
        over NIXL, unless `mapped_only`)."""
        for _ in range(2):
            got = self._arena_lease(mapped_only)
            if got is None:
                return None
            arena, lease = got
            try:
                result = transfer(arena, lease)
            finally:
                self._done(arena)
            if result is not _LEASE_REFUSED:
                return result
        return None

    def _refused_lease(self, lease: int) -> bool:
        """After a failed call: did it fail because the store forgot our lease?"""
        with self._lock:
            return self.available and self._lease_id != lease

    def _write_arena(self, ns, hashes: list[bytes], fill, mapped_only: bool = False) -> int | None:
        """Reserve, fill, checksum and commit, chunk by chunk, the commit of chunk k on a
        helper thread while chunk k+1 is reserved and filled. None: no arena here."""
        return self._leased(lambda arena, lease: self._write_chunks(ns, hashes, fill, arena, lease), mapped_only)

    def _write_chunks(self, ns, hashes: list[bytes], fill, arena: ArenaMapping | NixlRemote, lease: int):
        """Mapped here, `fill` writes into the reserved slots themselves; over NIXL into a staging
        slot, which one NIXL WRITE then puts into the reserved slots before the commit."""
        kept, pending = 0, collections.deque()   # commits in flight, at most _COMMITS_IN_FLIGHT
        nixl = isinstance(arena, NixlRemote)
        bb = ns.block_bytes
        try:
            step = self._step(ns, arena)
            for i in range(0, len(hashes), step):
                chunk = hashes[i:i + step]
                resp = self._call(self._stub.Reserve, kv_pb2.ReserveRequest(
                    namespace=ns, block_hashes=chunk, lease=kv_pb2.ShmWindow(lease_id=lease)),
                    self._deadline(0))
                if resp is None:
                    if i == 0 and self._refused_lease(lease):
                        return _LEASE_REFUSED
                    break
                reserved_at = time.monotonic()
                staged = arena.plane.stage(reserved_at + self.timeout_s) if nixl and resp.reserve_id else None
                idx, slots, offsets = [], [], []
                for j, slot in enumerate(resp.slots[:len(chunk)]):
                    view = None
                    if slot.status == _RESERVED:
                        if not nixl:
                            view = arena.slot(slot.offset, bb)
                        elif staged is not None and arena.valid(slot.offset, bb):
                            view = staged.block(len(slots), bb)
                            offsets.append(slot.offset)
                    if view is not None:
                        idx.append(i + j)
                        slots.append(view)
                    elif slot.status == kv_pb2.KV_PUT_STATUS_EXISTS:
                        kept += 1
                crcs, failed = None, False
                if slots and len(resp.slots) == len(chunk) and len(slots) == sum(
                        s.status == _RESERVED for s in resp.slots):
                    try:
                        crcs = fill(i, idx, slots)
                    except Exception as exc:  # noqa: BLE001 - a failed fill is a dropped save
                        self._log_once(f"kvstore save: filling the reserved slots failed ({type(exc).__name__}: "
                                       f"{str(exc)[:120]})")
                        failed = True
                elif resp.reserve_id:
                    failed = True             # a store answer we cannot use: give the slots back
                if staged is not None:
                    outcome = DONE
                    if not failed:
                        if crcs is None:      # computed before the staging slot is reused
                            crcs = self._map(lambda k: checksum(slots[k]), len(slots))
                        outcome = arena.transfer("WRITE", staged, list(enumerate(offsets)), bb,
                                                 time.monotonic() + self._deadline(len(slots) * bb))
                    staged.release()
                    if outcome != DONE:
                        self._nixl_failed(arena, outcome)
                        if outcome != FAILED:
                            break             # it may still land: no commit, no abort (the slots expire)
                        failed = True
                while len(pending) >= _COMMITS_IN_FLIGHT:
                    kept += pending.popleft().result()
                if resp.reserve_id:
                    pending.append(self._commits.submit(self._commit, lease, resp.reserve_id, slots, crcs, failed,
                                                        reserved_at))
                if failed:
                    break
        finally:
            while pending:
                kept += pending.popleft().result()
        return kept

    def _commit(self, lease: int, reserve_id: int, slots: list, crcs, abort: bool, reserved_at: float) -> int:
        """The store checks the slots against our checksums and keeps the good ones; how many."""
        try:
            if not abort and crcs is None:
                crcs = self._map(lambda k: checksum(slots[k]), len(slots))
            # Slots held past half the lease's life may have been taken back: never claim them.
            abort = abort or time.monotonic() - reserved_at > self._lease_ttl_s / 2
            resp = self._call(self._stub.Commit, kv_pb2.CommitRequest(
                lease=kv_pb2.ShmWindow(lease_id=lease), reserve_id=reserve_id,
                checksums=[] if abort else list(crcs), abort=abort),
                self._deadline(len(slots) * (len(slots[0]) if slots else 0)))
            return 0 if resp is None else sum(s in _KEPT for s in resp.statuses)
        except Exception as exc:  # noqa: BLE001 - never into the caller
            self._log_once(f"kvstore commit failed ({type(exc).__name__})")
            return 0
        finally:
            for v in slots:
                release_view(v)

    def _put_chunk(self, ns, chunk, window: Window | None) -> int:
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
        if not block_hashes:
            return []
        if self._skip():
            MISSES.labels(TIER).inc(len(block_hashes))
            return [False] * len(block_hashes)
        start = time.perf_counter()
        outs = [_nbytes(d) for d in dests]

        def copy_out(first: int, views: list, metas: list) -> list[bool | None]:
            # The copy is verified where it landed: the end-to-end check on the caller's bytes.
            def one(j: int) -> bool | None:
                out = outs[first + j]
                if views[j] is None or len(out) != len(views[j]):
                    return None
                return copy_and_checksum(out, views[j]) == metas[j].checksum
            return self._map(one, len(views))

        found = self._read_arena(ns, list(block_hashes), copy_out)
        if found is None:
            found = [False] * len(block_hashes)
            window = self._get_window()
            room = window.size if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES
            step = max(1, min(room // max(1, ns.block_bytes), kv_blocks.MAX_BLOCKS_PER_CALL))
            for i in range(0, len(block_hashes), step):
                self._get_chunk(ns, block_hashes[i:i + step], dests[i:i + step], found, i, window)
                if self._skip():
                    break
        return self._loaded(ns, found, start)

    def read_zero_copy(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes],
                       consume: Consume) -> list[bool] | None:
        """Load blocks straight out of the store's memory: None when no arena is mapped here
        (use get_into). Otherwise the found blocks are pinned and `consume(start, views)` is
        called on this thread, chunk by chunk (a chunk where nothing was found is skipped):
        views[i] is a read-only memoryview of block start+i inside the mapped arena, or None for
        a miss; consume copies them out (e.g. GPU DMAs) and returns once the copies are
        complete, keeping no view; returning False ends the load after this chunk (the later
        blocks are misses, never pinned). Meanwhile the client
        verifies every view's CRC-32C on its pool; then the blocks are unpinned (the corrupt
        ones reported to the store). True where the block was found and verified; a consume
        that raises makes its chunk misses and ends the load. Never raises."""
        if not block_hashes:
            return []
        if self._skip():
            MISSES.labels(TIER).inc(len(block_hashes))
            return [False] * len(block_hashes)
        start = time.perf_counter()

        def verify_beside(first: int, views: list, metas: list) -> list[bool | None]:
            crcs = [self._copies.submit(checksum, v) if v is not None else None for v in views]
            try:
                if consume(first, views) is False:
                    stop[0] = True
            except Exception as exc:  # noqa: BLE001 - the caller's copy failed: misses, reported once
                self._log_once(f"kvstore load: consume failed ({type(exc).__name__}: {str(exc)[:120]})")
                for f in crcs:
                    if f is not None:
                        f.result()
                raise _ConsumeFailed() from None
            return [None if f is None else f.result() == m.checksum for f, m in zip(crcs, metas)]

        stop = [False]
        found = self._read_arena(ns, list(block_hashes), verify_beside, stop, mapped_only=True)
        return None if found is None else self._loaded(ns, found, start)

    def _loaded(self, ns, found: list[bool], start: float) -> list[bool]:
        hits = sum(found)
        HITS.labels(TIER).inc(hits)
        MISSES.labels(TIER).inc(len(found) - hits)
        self._timed("load", hits * ns.block_bytes, start)
        return found

    def _read_arena(self, ns, hashes: list[bytes], handle, stop=(False,), mapped_only: bool = False) -> list[bool] | None:
        """Pin, hand the views to `handle(start, views, metas) -> [verified or None]`, release,
        chunk by chunk (until stop[0] is set). None: no arena here."""
        return self._leased(lambda arena, lease: self._read_chunks(ns, hashes, handle, arena, lease, stop), mapped_only)

    def _read_chunks(self, ns, hashes: list[bytes], handle, arena: ArenaMapping | NixlRemote, lease: int, stop):
        """Chunk k+1 is pinned (on a helper thread) while chunk k is consumed and verified, and
        chunk k is released in the background: the store's round trips overlap the copies."""
        found = [False] * len(hashes)
        step = self._step(ns, arena)
        starts = list(range(0, len(hashes), step))
        if not starts:
            return found

        def pin(i: int):
            return self._pin_chunk(ns, hashes[i:i + step], lease)
        ahead = self._rpcs.submit(pin, starts[0])
        releases = []
        try:
            for k, i in enumerate(starts):
                pinned, ahead = ahead.result(), None
                if pinned is not None and k and not all(m.block_hash for m in pinned[0].blocks):
                    # Pinned ahead with the previous chunk still held, a block on disk may have
                    # found no room in memory: once that chunk is given back, pin it again.
                    if pinned[0].read_id:
                        self._release_read(ns, lease, pinned[0].read_id, [])
                    for f in releases:
                        f.result()
                    pinned = pin(i)
                if pinned is not None and k + 1 < len(starts):
                    ahead = self._rpcs.submit(pin, starts[k + 1])
                if pinned is None:
                    return _LEASE_REFUSED if i == 0 and self._refused_lease(lease) else found
                chunk = hashes[i:i + step]
                ok, release = self._use_chunk(ns, chunk, i, arena, lease, handle, *pinned)
                if release is not None:
                    releases.append(self._rpcs.submit(release))
                found[i:i + len(ok)] = ok
                if len(ok) < len(chunk) or stop[0] or self._skip():
                    break   # the store lost, or the caller's consume failed or had enough
        finally:
            if ahead is not None:   # pinned for nothing: given back
                pinned = ahead.result()
                if pinned is not None and pinned[0].read_id:
                    self._release_read(ns, lease, pinned[0].read_id, [])
            for f in releases:
                f.result()
        return found

    def _pin_chunk(self, ns, chunk: list[bytes], lease: int):
        """(PinResponse, when it came) or None: the Pin failed."""
        resp = self._call(self._stub.Pin, kv_pb2.PinRequest(namespace=ns, block_hashes=chunk,
                                                            lease=kv_pb2.ShmWindow(lease_id=lease)),
                          self._deadline(len(chunk) * ns.block_bytes))
        return None if resp is None else (resp, time.monotonic())

    def _release_read(self, ns, lease: int, read_id: int, corrupt: list[int]) -> None:
        self._call(self._stub.Release, kv_pb2.ReleaseRequest(lease=kv_pb2.ShmWindow(lease_id=lease),
                                                             read_id=read_id, corrupt=corrupt),
                   self._deadline(len(corrupt) * ns.block_bytes))

    def _use_chunk(self, ns, chunk: list[bytes], first: int, arena: ArenaMapping | NixlRemote, lease: int, handle,
                   resp, pinned_at: float):
        """(found-and-verified per block of the chunk, shorter than the chunk: stop here; the
        release to run, or None)."""
        metas = list(resp.blocks)
        if len(metas) != len(chunk):
            metas = []   # an answer we cannot use: misses (and the pins given back)
        staged, failed = None, False
        if isinstance(arena, NixlRemote):
            views, staged, failed = self._nixl_read(arena, ns, metas, chunk)
        else:
            views = [arena.slot(m.offset, ns.block_bytes)
                     if m.block_hash == h and m.size == ns.block_bytes else None for m, h in zip(metas, chunk)]
        read_only = [v.toreadonly() if v is not None else None for v in views]
        try:
            verified = handle(first, read_only, metas) if any(v is not None for v in views) else [None] * len(views)
        except _ConsumeFailed:
            verified, failed = [None] * len(views), True
        finally:
            for v in read_only + views:
                release_view(v)
            if staged is not None:
                staged.release()
        # Pins held past half the lease's life may have been taken back: never trust those bytes.
        late = time.monotonic() - pinned_at > self._lease_ttl_s / 2
        release = None
        if resp.read_id:
            corrupt = [j for j, ok in enumerate(verified) if ok is False] if not late else []
            release = lambda: self._release_read(ns, lease, resp.read_id, corrupt)  # noqa: E731
        if failed:
            return [], release   # shorter than the chunk: the load ends here
        return [bool(v) and not late for v in verified] + [False] * (len(chunk) - len(verified)), release

    def _nixl_read(self, remote: NixlRemote, ns, metas: list, chunk: list[bytes]):
        """(views, the staging slot they are in or None, failed): one NIXL READ of the pinned
        blocks into a staging slot, block j of the chunk at j * block_bytes; views[j] is None for
        a miss. A READ that fails or misses its deadline makes every block a miss and ends the load."""
        bb = ns.block_bytes
        views: list = [None] * len(metas)
        want = [j for j, (m, h) in enumerate(zip(metas, chunk))
                if m.block_hash == h and m.size == bb and remote.valid(m.offset, bb)]
        if not want:
            return views, None, False
        deadline = time.monotonic() + self._deadline(len(want) * bb)
        staged = remote.plane.stage(deadline)
        if staged is None:
            return views, None, True
        outcome = remote.transfer("READ", staged, [(j, metas[j].offset) for j in want], bb, deadline)
        if outcome != DONE:
            self._nixl_failed(remote, outcome)
            return views, staged, True
        for j in want:
            views[j] = staged.block(j, bb)
        return views, staged, False

    def _nixl_failed(self, remote: NixlRemote, outcome: str) -> None:
        """A NIXL transfer failed or timed out (a UCX path that does not work, a store gone):
        gRPC bytes for NIXL_RETRY_S, then NIXL again (the store's agent loaded anew)."""
        with self._lock:
            if self._arena is not remote:
                return
            self._arena, self._lease_id = None, 0
            self._open_retry_at = time.monotonic() + NIXL_RETRY_S
        self._retire(remote)
        self._log_once(f"kvstore {self.address}: a NIXL transfer {'failed' if outcome == FAILED else 'timed out'}: "
                       f"gRPC bytes for {NIXL_RETRY_S:.0f} s, then NIXL again")

    def _get_chunk(self, ns, hashes, dests, found: list[bool], base: int, window: Window | None) -> None:
        nbytes = len(hashes) * ns.block_bytes
        if window is not None and nbytes <= window.size:
            with window.lock:
                if self._window is window:
                    resp = self._call(self._stub.Get, kv_pb2.GetRequest(namespace=ns, block_hashes=list(hashes),
                                                                        window=window.lease), self._deadline(nbytes))
                    if resp is not None:
                        def fill(j: int) -> bool:
                            m = resp.blocks[j]
                            return bool(m.meta.block_hash) and m.meta.offset + m.meta.size <= window.size and _fill(
                                dests[j], window.view[m.meta.offset:m.meta.offset + m.meta.size], m.meta, ns)
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
        if n == 0:
            return []
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
            arena, self._arena = self._arena, None
            lease, self._lease_id = self._lease_id, 0
        if window is not None:
            self._close_lease(window.lease.lease_id)
            window.close()
        if lease:
            self._close_lease(lease)
        if arena is not None:
            self._retire(arena)
        self._channel.close()
        self._copies.shutdown(wait=False)
        self._commits.shutdown(wait=False)
        self._rpcs.shutdown(wait=False)


_LEASE_REFUSED = object()   # a zero-copy transfer's first call: the store does not know our lease


class _ConsumeFailed(Exception):
    """The caller's consume raised (already logged): its chunk is a miss and the load ends."""


def _kept(resp: "kv_pb2.PutResponse | None") -> int:
    if resp is None:
        return 0
    return sum(1 for s in resp.statuses if s in _KEPT)


def _fill(dest, src, meta: "kv_pb2.KvBlockMeta", ns: "kv_pb2.KvNamespace") -> bool:
    """Copy a block into its destination and verify what landed there (the end-to-end check)."""
    out = _nbytes(dest)
    if meta.size != ns.block_bytes or len(src) != ns.block_bytes or len(out) != ns.block_bytes:
        return False
    return copy_and_checksum(out, src) == meta.checksum
