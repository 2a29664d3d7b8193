"""grpc.aio adapter: meshllm.v1.KvStore over a Store, plus the same-host shared memory: the memory
backend's block memfd that clients map for zero-copy transfers (Pin/Release, Reserve/Commit,
transfers.py) or reach over NIXL when they cannot map it (nixl_export.py: the same Pin/Reserve,
the bytes moved by the client), and the leased windows of arena.py (for the Redis backend).

Copies, checksums, disk and Redis run in a small thread pool, so the event loop keeps answering
health checks while a 64 MiB batch moves."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import kv_blocks
from services.common.kv_blocks import NamespaceError, copy_into, kv_pb2
from services.kvstore import metrics
from services.kvstore.arena import Arena, LeaseError
from services.kvstore.call_timing import timed_call as _timed_call, timed_commit
from services.kvstore.nixl_export import NixlExport
from services.kvstore.store import PutStatus, Store
from services.kvstore.transfers import TooManyTransfers, Transfer, Transfers
from services.kvstore.verifier import CommitVerifier

import services  # noqa: F401,E402
from meshllm.v1 import kv_pb2_grpc  # noqa: E402

log = logging.getLogger("meshllm.kvstore.server")
SERVICE_NAME = kv_pb2.DESCRIPTOR.services_by_name["KvStore"].full_name
_PUT_PB = {PutStatus.STORED: kv_pb2.KV_PUT_STATUS_STORED, PutStatus.EXISTS: kv_pb2.KV_PUT_STATUS_EXISTS,
           PutStatus.BAD_CHECKSUM: kv_pb2.KV_PUT_STATUS_BAD_CHECKSUM, PutStatus.BAD_SIZE: kv_pb2.KV_PUT_STATUS_BAD_SIZE,
           PutStatus.TOO_LARGE: kv_pb2.KV_PUT_STATUS_TOO_LARGE, PutStatus.FAILED: kv_pb2.KV_PUT_STATUS_FAILED,
           PutStatus.RESERVED: kv_pb2.KV_PUT_STATUS_RESERVED}


def _checked(ns: "kv_pb2.KvNamespace", hashes) -> bytes:
    kv_blocks.check_namespace(ns)
    for h in hashes:
        kv_blocks.check_hash(h)
    return kv_blocks.namespace_id(ns)


def zero_copy_transfers(store: Store, lease_ttl_s: float, **kw) -> Transfers:
    """The leases of zero-copy clients; what expires is given back to the store."""
    def give_back(t: Transfer) -> None:
        if t.kind == "read":
            store.unpin(t.blocks)
        else:
            store.abort(t.blocks)
    return Transfers(lease_ttl_s, give_back, **kw)


class KvStoreServicer(kv_pb2_grpc.KvStoreServicer):
    def __init__(self, store: Store, arena: Arena | None, executor: ThreadPoolExecutor,
                 copies: ThreadPoolExecutor, transfers: Transfers | None = None, *,
                 zero_copy: bool = True, nixl: NixlExport | None = None,
                 verifier: CommitVerifier | None = None) -> None:
        self.store = store
        self.arena = arena            # windows (any backend), or None
        self.transfers = transfers    # leases, pins and slots of zero copy and NIXL, or None
        self.zero_copy = zero_copy and transfers is not None   # same-host clients may map the memfd
        self.nixl = nixl if transfers is not None else None    # the memfd registered with NIXL, or None
        self._executor = executor    # one call's work, off the event loop
        self._copies = copies        # the blocks of one call, in parallel
        self.verifier = verifier     # zero-copy commits checked after they answer, or None: before

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run_holding(self, give_back, fn, *args):
        """_run for work that takes pins or slots: if the call is cancelled meanwhile (the
        client's deadline), they are given back when the work ends instead of being lost."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def undo(f) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._executor.submit(give_back, f.result())
            fut.add_done_callback(undo)
            raise

    def expire(self) -> None:
        if self.transfers is not None:
            self.transfers.expire()

    async def _window(self, window: "kv_pb2.ShmWindow", context) -> memoryview | None:
        if not window.lease_id:
            return None
        if self.arena is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this kvstore has no shared-memory arena")
        try:
            return self.arena.window(window.lease_id)
        except LeaseError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def Lookup(self, request, context):
        if len(request.block_hashes) > kv_blocks.MAX_LOOKUP_HASHES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes: at most {kv_blocks.MAX_LOOKUP_HASHES} per Lookup")
        try:
            ns_id = _checked(request.namespace, request.block_hashes)
        except NamespaceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        found = await self._run(self.store.lookup, ns_id, list(request.block_hashes))
        metrics.LOOKUPS.inc()
        return kv_pb2.LookupResponse(num_found=found)

    async def Put(self, request, context):
        if len(request.blocks) > kv_blocks.MAX_BLOCKS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"blocks: at most {kv_blocks.MAX_BLOCKS_PER_CALL} per Put")
        try:
            ns_id = _checked(request.namespace, [b.meta.block_hash for b in request.blocks])
        except NamespaceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        window = await self._window(request.window, context)
        statuses = await self._run(self._put, ns_id, request.namespace.block_bytes, request.blocks, window)
        for s in statuses:
            metrics.PUTS.labels(s.value).inc()
        return kv_pb2.PutResponse(statuses=[_PUT_PB[s] for s in statuses])

    def _put(self, ns_id: bytes, block_bytes: int, blocks, window: memoryview | None) -> list[PutStatus]:
        self.expire()   # slots held by an expired lease are room for this put
        statuses: list[PutStatus | None] = [None] * len(blocks)
        checked, where = [], []
        for i, b in enumerate(blocks):
            m = b.meta
            if m.size != block_bytes or (window is not None and m.offset + m.size > len(window)):
                statuses[i] = PutStatus.BAD_SIZE
                continue
            data = window[m.offset:m.offset + m.size] if window is not None else b.data
            checked.append((m.block_hash, data, m.checksum))
            where.append(i)
        # Blocks are copied and checked on several threads (both release the GIL).
        for i, status in zip(where, self.store.put_batch(ns_id, block_bytes, checked, self._map(len(checked)))):
            statuses[i] = status
        return statuses

    def _map(self, n: int):
        return self._copies.map if n > 1 else map

    async def Get(self, request, context):
        if len(request.block_hashes) > kv_blocks.MAX_BLOCKS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes: at most {kv_blocks.MAX_BLOCKS_PER_CALL} per Get")
        try:
            ns_id = _checked(request.namespace, request.block_hashes)
        except NamespaceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        window = await self._window(request.window, context)
        if window is not None and request.window_offset > len(window):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "window_offset is past the window")
        found = await self._run(self._get, ns_id, request.namespace.block_bytes, list(request.block_hashes),
                                window, request.window_offset)
        hits = sum(1 for meta, _ in found if meta is not None)
        metrics.GETS.labels("hit").inc(hits)
        metrics.GETS.labels("miss").inc(len(found) - hits)
        if window is not None:
            return kv_pb2.GetResponse(blocks=[kv_pb2.KvBlock(meta=meta) if meta is not None else kv_pb2.KvBlock()
                                              for meta, _ in found])
        return kv_blocks.encode_get_response(found)   # serialized by hand: see kv_blocks

    def _get(self, ns_id: bytes, block_bytes: int, hashes: list[bytes], window: memoryview | None,
             offset: int) -> list[tuple["kv_pb2.KvBlockMeta | None", object]]:
        """(meta, bytes) of each found block, (None, None) for a miss; with a window, the bytes are
        copied into it (block i into slot i) and not returned."""
        room = len(window) - offset if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES
        fits = min(len(hashes), room // block_bytes)   # what does not fit is a miss: the client asks again
        found = self.store.get_batch(ns_id, block_bytes, hashes[:fits], self._map(fits))

        def one(i: int):
            if i >= fits or found[i] is None:
                return None, None
            data, crc = found[i]
            meta = kv_pb2.KvBlockMeta(block_hash=hashes[i], size=len(data), checksum=crc)
            if window is None:
                return meta, data
            meta.offset = offset + i * block_bytes   # a miss leaves its slot unused
            copy_into(window[meta.offset:meta.offset + block_bytes], data)   # verified by the store
            return meta, None

        return list(self._map(len(hashes))(one, range(len(hashes))))

    async def OpenArena(self, request, context):
        if request.zero_copy and (self.zero_copy or self.nixl is not None):
            lease_id = await self._run(self.transfers.open)
            if lease_id is not None:
                f = self.store.arena
                resp = kv_pb2.OpenArenaResponse(nonce=f.nonce, lease_id=lease_id, lease_ttl_s=self.transfers.ttl_s,
                                                arena_bytes=f.size,
                                                nixl_agent=self.nixl.name if self.nixl is not None else "")
                if self.zero_copy:
                    resp.path, resp.boot_id, resp.zero_copy = f.path, f.boot_id, True
                return resp
        lease = self.arena.open_window() if self.arena is not None else None
        if lease is None:
            return kv_pb2.OpenArenaResponse()
        a = self.arena
        return kv_pb2.OpenArenaResponse(path=a.path, boot_id=a.boot_id, nonce=a.nonce, lease_id=lease.lease_id,
                                        window_offset=a.window_offset(lease), window_bytes=a.window_bytes,
                                        lease_ttl_s=a.lease_ttl_s)

    async def CloseArena(self, request, context):
        lease_id = request.window.lease_id
        if self.transfers is not None and await self._run(self.transfers.close, lease_id):
            return kv_pb2.CloseArenaResponse()
        if self.arena is not None:
            self.arena.close_window(lease_id)
        return kv_pb2.CloseArenaResponse()

    # ---- zero copy ------------------------------------------------------------------------
    async def _zero_copy_call(self, request, context, hashes) -> tuple[bytes, int]:
        """(namespace id, lease id) of a Pin or Reserve, or the call is aborted."""
        if len(hashes) > kv_blocks.MAX_BLOCKS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes: at most {kv_blocks.MAX_BLOCKS_PER_CALL} per call")
        try:
            ns_id = _checked(request.namespace, hashes)
        except NamespaceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return ns_id, await self._lease(request.lease, context)

    async def _lease(self, lease: "kv_pb2.ShmWindow", context) -> int:
        if self.transfers is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this kvstore has no zero-copy or NIXL arena")
        if not lease.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease.lease_id is required")
        try:
            self.transfers.renew(lease.lease_id)
        except LeaseError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return lease.lease_id

    async def _add(self, lease_id: int, transfer: Transfer, context) -> int:
        try:
            return self.transfers.add(lease_id, transfer)
        except (LeaseError, TooManyTransfers) as exc:
            await self._run(self.transfers.give_back, transfer)
            code = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(exc, LeaseError)
                    else grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(code, str(exc))

    @_timed_call("pin")
    async def Pin(self, request, context):
        hashes = list(request.block_hashes)
        ns_id, lease_id = await self._zero_copy_call(request, context, hashes)
        block_bytes = request.namespace.block_bytes
        pinned = await self._run_holding(self.store.unpin, self._pin, ns_id, block_bytes, hashes)
        hits = sum(e is not None for e in pinned)
        metrics.GETS.labels("hit").inc(hits)
        metrics.GETS.labels("miss").inc(len(hashes) - hits)
        read_id = 0
        if hits:
            read_id = await self._add(lease_id, Transfer("read", ns_id, hashes, pinned, block_bytes), context)
        return kv_pb2.PinResponse(read_id=read_id, blocks=[
            kv_pb2.KvBlockMeta(block_hash=h, size=e.size, checksum=e.crc, offset=e.offset) if e is not None
            else kv_pb2.KvBlockMeta() for h, e in zip(hashes, pinned)])

    def _pin(self, ns_id: bytes, block_bytes: int, hashes: list[bytes]) -> list:
        self.expire()   # what expired may be what a pin or a reservation needs
        return self.store.pin(ns_id, block_bytes, hashes)

    async def Release(self, request, context):
        if len(request.corrupt) > kv_blocks.MAX_BLOCKS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"corrupt: at most {kv_blocks.MAX_BLOCKS_PER_CALL} indices")
        lease_id = await self._lease(request.lease, context)
        t = self.transfers.take(lease_id, request.read_id, "read")
        if t is None:
            return kv_pb2.ReleaseResponse()   # expired (and given back) already
        corrupt = list(request.corrupt)
        if any(i >= len(t.hashes) for i in corrupt):
            await self._run(self.store.unpin, t.blocks)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "corrupt: an index past the Pin's blocks")
        bad = await self._run(self.store.release, t.ns_id, t.hashes, t.blocks, corrupt, self._map(len(corrupt)))
        if corrupt:
            log.warning("a reader reported %d corrupt blocks; %d were (removed)", len(set(corrupt)), bad)
        return kv_pb2.ReleaseResponse(corrupt_removed=bad)

    @_timed_call("reserve")
    async def Reserve(self, request, context):
        hashes = list(request.block_hashes)
        ns_id, lease_id = await self._zero_copy_call(request, context, hashes)
        block_bytes = request.namespace.block_bytes
        slots = await self._run_holding(self.store.abort, self._reserve, ns_id, block_bytes, hashes)
        reserve_id = 0
        if any(not isinstance(s, PutStatus) for s in slots):
            reserve_id = await self._add(lease_id, Transfer("reserve", ns_id, hashes, slots, block_bytes), context)
        for s in slots:
            if isinstance(s, PutStatus):
                metrics.PUTS.labels(s.value).inc()
        return kv_pb2.ReserveResponse(reserve_id=reserve_id, slots=[
            kv_pb2.KvSlot(status=_PUT_PB[s]) if isinstance(s, PutStatus)
            else kv_pb2.KvSlot(status=kv_pb2.KV_PUT_STATUS_RESERVED, offset=s.offset) for s in slots])

    def _reserve(self, ns_id: bytes, block_bytes: int, hashes: list[bytes]) -> list:
        self.expire()
        return self.store.reserve(ns_id, block_bytes, hashes)

    @_timed_call("commit")
    async def Commit(self, request, context):
        lease_id = await self._lease(request.lease, context)
        t = self.transfers.take(lease_id, request.reserve_id, "reserve")
        if t is None:
            return kv_pb2.CommitResponse()    # expired: its slots were given back
        where = [i for i, s in enumerate(t.blocks) if not isinstance(s, PutStatus)]
        if request.abort:
            await self._run(self.store.abort, t.blocks)
            return kv_pb2.CommitResponse()
        if len(request.checksums) != len(where):
            await self._run(self.store.abort, t.blocks)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"checksums: {len(request.checksums)} given for {len(where)} reserved slots")
        claimed = [0] * len(t.blocks)
        for i, crc in zip(where, request.checksums):
            claimed[i] = crc
        statuses = await self._run(self._commit, t, claimed, len(where))
        out = [statuses[i] for i in where]
        for s in out:
            metrics.PUTS.labels(s.value).inc()
        return kv_pb2.CommitResponse(statuses=[_PUT_PB[s] for s in out])

    def _commit(self, t: Transfer, claimed: list[int], n: int) -> list[PutStatus]:
        """Store a reservation's slots: checked first, or (admitted by the verifier) stored
        unverified and handed to it, here on the call's thread so a cancelled call loses none."""
        v = self.verifier
        later = v is not None and v.admit(n * t.block_bytes)
        statuses: list[PutStatus] = []
        try:
            statuses = timed_commit(self.store.commit, t.ns_id, t.block_bytes, t.hashes, t.blocks, claimed,
                                    map if later else self._map(n), not later)
        finally:
            if later:
                v.submit(t.ns_id, [(h, slot) for h, slot, s in zip(t.hashes, t.blocks, statuses)
                                   if s is PutStatus.STORED], n * t.block_bytes)
        return statuses

    async def NixlMetadata(self, request, context):
        await self._lease(request.lease, context)   # only a client holding a lease learns where to READ / WRITE
        if self.nixl is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this kvstore does not offer NIXL")
        x = self.nixl
        return kv_pb2.NixlMetadataResponse(agent_name=x.name, agent_metadata=x.metadata, arena_address=x.address,
                                           arena_bytes=x.size)

    async def Stats(self, request, context):
        backend, counters = await self._run(self._stats)
        a, z = self.arena, self.transfers
        shared = (a.size if a else 0) + (self.store.arena.size if z else 0)
        return kv_pb2.StatsResponse(
            arena_leases=z.leases if z else 0, transfers=z.in_flight() if z else 0,
            pinned_blocks=backend.extra.get("pins", 0), reserved_bytes=backend.extra.get("reserved_bytes", 0),
            backend=backend.name, blocks=backend.blocks, bytes=backend.bytes, capacity_bytes=backend.capacity_bytes,
            disk_blocks=backend.disk_blocks, disk_bytes=backend.disk_bytes,
            disk_capacity_bytes=backend.disk_capacity_bytes, hits=counters.hits, misses=counters.misses,
            evictions=backend.evictions, corrupt_blocks=backend.corrupt_blocks,
            arena_bytes=shared, arena_windows=a.leased if a else 0, nixl=self.nixl is not None)

    def _stats(self):
        self.expire()
        return self.store.stats()

    async def Flush(self, request, context):
        if request.HasField("namespace"):
            try:
                ns_id = _checked(request.namespace, [])
            except NamespaceError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        elif request.all_namespaces:
            ns_id = None
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Flush names a namespace, or sets all_namespaces to flush everything")
        removed = await self._run(self.store.flush, ns_id)
        log.info("flush namespace=%s removed=%d", "all" if ns_id is None else ns_id.hex()[:8], removed)
        return kv_pb2.FlushResponse(blocks_removed=removed)
