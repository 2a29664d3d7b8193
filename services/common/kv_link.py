"""One kvstore as the client reaches it (docs/kvstore.md): the gRPC channel, whether the store
answers, and the data plane leased on it. KvClient (kv_client.py) makes one and calls through it;
the chunked zero-copy transfers (kv_transfers.py) run under its leases.

    link = KvLink(address, credentials, data_plane="auto", ...)
    resp = link.call(link.stub.Lookup, request, timeout)    # None: failed (and accounted)
    link.skip()                         # the store is lost and its retry time not come: a miss now
    result = link.leased(transfer)      # transfer(arena, lease) under a live lease; None: no arena here
    window = link.get_window()          # a leased shared-memory window, or None

Planes, fastest first: the store's block memory mapped here (kv_shm.ArenaMapping), the same
memory over NIXL (kv_nixl.NixlRemote), a window (kv_shm.Window), else none (gRPC bytes). OpenArena
picks the first that works here; a plane that cannot work is asked for again a minute later, a
failed NIXL transfer gives gRPC bytes for NIXL_RETRY_S. A store lost for KEEP_LOST_ARENA_S has its
arena unmapped; a lease the store forgot (FAILED_PRECONDITION) is replaced at once. One lock
guards availability and the plane together: losing the store drops its window and lease."""
from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable

import grpc

from services.common.grpc_server import GRPC_OPTIONS
from services.common.kv_blocks import kv_pb2
from services.common.kv_metrics import AVAILABLE, TIER
from services.common.kv_nixl import FAILED, NixlPlane, NixlRemote
from services.common.kv_shm import ArenaMapping, Window, boot_id

import services  # noqa: F401,E402
from meshllm.v1 import kv_pb2_grpc  # noqa: E402

log = logging.getLogger("meshllm.kv_client")

KEEP_LOST_ARENA_S = 30.0   # a store lost this long: its arena is unmapped (its memory given back)
NIXL_RETRY_S = 10.0        # after a failed NIXL transfer: gRPC bytes this long, then NIXL again
LEASE_REFUSED = object()   # a zero-copy transfer's first call: the store does not know our lease


class KvLink:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None, *, data_plane: str,
                 window_bytes: int, timeout_s: float, lookup_timeout_s: float, min_gbps: float,
                 retry_after_s: float, max_retry_after_s: float, nixl_slot_bytes: int, nixl_slots: int) -> None:
        self.address = address
        self.data_plane = data_plane        # "auto", "zero_copy", "nixl", "shm" or "grpc" (KvClient checked it)
        self.use_shm = data_plane != "grpc"
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
        self.stub = kv_pb2_grpc.KvStoreStub(self._channel)
        # Put with a request serialized by hand (kv_blocks.encode_put_request): protobuf's own
        # serializer is the slowest step of gRPC bytes.
        self.put_raw = self._channel.unary_unary("/meshllm.v1.KvStore/Put", request_serializer=None,
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
        self._nixl_slot_bytes = nixl_slot_bytes
        self._nixl_slots = nixl_slots
        self._nixl: NixlPlane | bool | None = None
        self.lease_ttl_s = 0.0               # the store's lease life (set under the lock by _open)
        self._lease_used = 0.0
        self._open_retry_at = 0.0
        self._hooks: tuple[Callable | None, Callable | None] = (None, None)
        self._refusals: set[str] = set()   # reasons already logged (bounded)
        AVAILABLE.labels(TIER).set(1)
    # ---- availability ------------------------------------------------------------------
    def skip(self) -> bool:
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

    def call(self, method, request, timeout: float):
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
                self.log_once(f"kvstore refused a call ({code.name}): {details[:200]}", logging.ERROR)
            else:
                self._lost(exc)
            return None
        self._ok()
        return resp

    def log_once(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self._refusals and len(self._refusals) < 32:
            self._refusals.add(message)
            log.log(level, "%s", message)

    def deadline(self, nbytes: int) -> float:
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
                and time.monotonic() - self._lease_used < self.lease_ttl_s / 2)

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
            resp = self.call(self.stub.OpenArena, kv_pb2.OpenArenaRequest(
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
                self.lease_ttl_s, self._lease_used, self._open_retry_at = resp.lease_ttl_s, time.monotonic(), 0.0
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
        meta = self.call(self.stub.NixlMetadata, kv_pb2.NixlMetadataRequest(
            lease=kv_pb2.ShmWindow(lease_id=resp.lease_id)), self.timeout_s)
        if meta is None or meta.agent_name != resp.nixl_agent or meta.arena_bytes != resp.arena_bytes:
            return None, f"{why}; no usable NIXL metadata"
        try:
            return self._nixl.load(meta), ""
        except Exception as exc:  # noqa: BLE001
            return None, f"{why}; NIXL could not load the kvstore's agent ({type(exc).__name__}: {exc})"

    def _close_lease(self, lease_id: int) -> None:
        try:
            self.stub.CloseArena(kv_pb2.CloseArenaRequest(window=kv_pb2.ShmWindow(lease_id=lease_id)),
                                  timeout=self.lookup_timeout_s)
        except grpc.RpcError:
            pass   # the lease expires on its own

    def get_window(self) -> Window | None:
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
        return "shm" if self.get_window() is not None else "grpc"

    def leased(self, transfer, mapped_only: bool = False):
        """transfer(arena, lease) under a live lease; once more under a new one when the store
        did not know ours (it restarted unnoticed, or the lease ended): then the transfer
        answers LEASE_REFUSED before it did anything. None: no arena mapped here (or reached
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
            if result is not LEASE_REFUSED:
                return result
        return None

    def refused_lease(self, lease: int) -> bool:
        """After a failed call: did it fail because the store forgot our lease?"""
        with self._lock:
            return self.available and self._lease_id != lease

    def nixl_failed(self, remote: NixlRemote, outcome: str) -> None:
        """A NIXL transfer failed or timed out (a UCX path that does not work, a store gone):
        gRPC bytes for NIXL_RETRY_S, then NIXL again (the store's agent loaded anew)."""
        with self._lock:
            if self._arena is not remote:
                return
            self._arena, self._lease_id = None, 0
            self._open_retry_at = time.monotonic() + NIXL_RETRY_S
        self._retire(remote)
        self.log_once(f"kvstore {self.address}: a NIXL transfer {'failed' if outcome == FAILED else 'timed out'}: "
                      f"gRPC bytes for {NIXL_RETRY_S:.0f} s, then NIXL again")


    @property
    def window(self) -> Window | None:
        """The window in use now (a transfer holding an older one checks it was not dropped)."""
        return self._window

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
