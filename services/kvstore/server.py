"""grpc.aio adapter: meshllm.v1.KvStore over a Store, plus the shared-memory arena.

Copies, checksums, disk and Redis run in a small thread pool, so the event loop keeps answering
health checks while a 64 MiB batch moves."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import kv_blocks
from services.common.grpc_server import bind, make_server
from services.common.kv_blocks import NamespaceError, copy_into, kv_pb2
from services.common.metrics import start_metrics_server
from services.kvstore import metrics
from services.kvstore.arena import Arena, LeaseError
from services.kvstore.config import MIB, KvStoreConfig
from services.kvstore.store import PutStatus, Store

import services  # noqa: F401,E402
from meshllm.v1 import kv_pb2_grpc  # noqa: E402

log = logging.getLogger("meshllm.kvstore.server")
SERVICE_NAME = kv_pb2.DESCRIPTOR.services_by_name["KvStore"].full_name
_PUT_PB = {PutStatus.STORED: kv_pb2.KV_PUT_STATUS_STORED, PutStatus.EXISTS: kv_pb2.KV_PUT_STATUS_EXISTS,
           PutStatus.BAD_CHECKSUM: kv_pb2.KV_PUT_STATUS_BAD_CHECKSUM, PutStatus.BAD_SIZE: kv_pb2.KV_PUT_STATUS_BAD_SIZE,
           PutStatus.TOO_LARGE: kv_pb2.KV_PUT_STATUS_TOO_LARGE, PutStatus.FAILED: kv_pb2.KV_PUT_STATUS_FAILED}


def _checked(ns: "kv_pb2.KvNamespace", hashes) -> bytes:
    kv_blocks.check_namespace(ns)
    for h in hashes:
        kv_blocks.check_hash(h)
    return kv_blocks.namespace_id(ns)


class KvStoreServicer(kv_pb2_grpc.KvStoreServicer):
    def __init__(self, store: Store, arena: Arena | None, executor: ThreadPoolExecutor,
                 copies: ThreadPoolExecutor) -> None:
        self.store = store
        self.arena = arena
        self._executor = executor    # one call's work, off the event loop
        self._copies = copies        # the blocks of one call, in parallel

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

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
        lease = self.arena.open_window() if self.arena is not None else None
        if lease is None:
            return kv_pb2.OpenArenaResponse()
        a = self.arena
        return kv_pb2.OpenArenaResponse(path=a.path, boot_id=a.boot_id, nonce=a.nonce, lease_id=lease.lease_id,
                                        window_offset=a.window_offset(lease), window_bytes=a.window_bytes,
                                        lease_ttl_s=a.lease_ttl_s)

    async def CloseArena(self, request, context):
        if self.arena is not None:
            self.arena.close_window(request.window.lease_id)
        return kv_pb2.CloseArenaResponse()

    async def Stats(self, request, context):
        backend, counters = await self._run(self.store.stats)
        a = self.arena
        return kv_pb2.StatsResponse(
            backend=backend.name, blocks=backend.blocks, bytes=backend.bytes, capacity_bytes=backend.capacity_bytes,
            disk_blocks=backend.disk_blocks, disk_bytes=backend.disk_bytes,
            disk_capacity_bytes=backend.disk_capacity_bytes, hits=counters.hits, misses=counters.misses,
            evictions=backend.evictions, corrupt_blocks=backend.corrupt_blocks,
            arena_bytes=a.size if a else 0, arena_windows=a.leased if a else 0)

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


def _handlers(servicer: KvStoreServicer) -> grpc.GenericRpcHandler:
    """The generated registration, except that a response may also be bytes already serialized
    (Get's gRPC-bytes answer, kv_blocks.encode_get_response)."""
    def serialize(message) -> bytes:
        return message if isinstance(message, bytes) else message.SerializeToString()

    methods = {name: getattr(kv_pb2, f"{name}Request") for name in
               ("Lookup", "Put", "Get", "OpenArena", "CloseArena", "Stats", "Flush")}
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), request_deserializer=req.FromString,
                                                  response_serializer=serialize)
        for name, req in methods.items()})


def build_backend(cfg: KvStoreConfig):
    if cfg.backend == "memory":
        from services.kvstore.memory import MemoryBackend
        spill = None
        if cfg.disk_dir:
            from services.kvstore.disk import DiskTier
            spill = DiskTier(cfg.disk_dir, cfg.disk_bytes)
        return MemoryBackend(cfg.capacity_bytes, spill)
    from services.kvstore.redis_backend import RedisBackend
    return RedisBackend(cfg.backend, cfg.capacity_bytes)


async def serve(cfg: KvStoreConfig, stop: asyncio.Event) -> int:
    store = Store(build_backend(cfg))
    arena = Arena(cfg.shm_window_mb * MIB, cfg.shm_windows, cfg.lease_ttl_s) if cfg.shm_windows else None
    executor = ThreadPoolExecutor(cfg.worker_threads, thread_name_prefix="kvstore")
    server, health = make_server("kvstore", [SERVICE_NAME])
    copies = ThreadPoolExecutor(cfg.copy_threads, thread_name_prefix="kvstore-copy")
    servicer = KvStoreServicer(store, arena, executor, copies)
    server.add_generic_rpc_handlers((_handlers(servicer),))
    port = bind(server, cfg.address, cfg.internal_tls.server_credentials())
    await server.start()
    health.set_ready(True)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"kvstore listening on {host}:{port} backend={store.backend.name} "
          f"capacity={cfg.capacity_bytes} arena={arena.size if arena else 0}", flush=True)
    metrics_port = start_metrics_server(cfg.host, cfg.metrics_port)
    if metrics_port:
        print(f"kvstore metrics on http://{host}:{metrics_port}/metrics", flush=True)
    gauges = asyncio.create_task(metrics.refresh_gauges(store, executor))
    try:
        await stop.wait()
    finally:
        gauges.cancel()
        health.set_ready(False, "stopping")
        await server.stop(grace=2.0)
        executor.shutdown(wait=False, cancel_futures=True)
        copies.shutdown(wait=False, cancel_futures=True)
        store.backend.close()
        if arena is not None:
            arena.close()
        log.info("stopped")
    return 0
