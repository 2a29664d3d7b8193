"""The kvstore process: the backend, the shared memory, the thread pools, the commit verifier
and the gRPC server assembled from one validated config (main.py), and torn down in order."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.grpc_server import bind, make_server
from services.common.kv_blocks import kv_pb2
from services.common.metrics import start_metrics_server
from services.kvstore import metrics
from services.kvstore.arena import Arena
from services.kvstore.config import MIB, KvStoreConfig
from services.kvstore.nixl_export import start_nixl
from services.kvstore.server import SERVICE_NAME, KvStoreServicer, zero_copy_transfers
from services.kvstore.store import Store
from services.kvstore.verifier import CommitVerifier

log = logging.getLogger("meshllm.kvstore.server")


def _handlers(servicer: KvStoreServicer) -> grpc.GenericRpcHandler:
    """The generated registration, except that a response may also be bytes already serialized
    (Get's gRPC-bytes answer, kv_blocks.encode_get_response)."""
    def serialize(message) -> bytes:
        return message if isinstance(message, bytes) else message.SerializeToString()

    methods = {name: getattr(kv_pb2, f"{name}Request") for name in
               ("Lookup", "Put", "Get", "OpenArena", "CloseArena", "Pin", "Release", "Reserve", "Commit",
                "NixlMetadata", "Stats", "Flush")}
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), request_deserializer=req.FromString,
                                                  response_serializer=serialize)
        for name, req in methods.items()})


async def _expire_every(servicer: KvStoreServicer, executor, every_s: float) -> None:
    """A client killed mid-transfer holds pins and slots until its lease expires: give them back
    even when no call comes (calls expire them too, before they need room)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every_s)
        await loop.run_in_executor(executor, servicer.expire)


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
    try:
        nixl = start_nixl(cfg.nixl, store.arena)
    except RuntimeError as exc:   # --nixl asked for and impossible: fail fast
        log.error("%s", exc)
        store.backend.close()
        return 2
    arena = Arena(cfg.shm_window_mb * MIB, cfg.shm_windows, cfg.lease_ttl_s) if cfg.shm_windows else None
    executor = ThreadPoolExecutor(cfg.worker_threads, thread_name_prefix="kvstore")
    server, health = make_server("kvstore", [SERVICE_NAME])
    copies = ThreadPoolExecutor(cfg.copy_threads, thread_name_prefix="kvstore-copy")
    transfers = (zero_copy_transfers(store, cfg.lease_ttl_s)
                 if (cfg.zero_copy or nixl is not None) and store.arena is not None else None)
    verifier, checks = None, None
    if transfers is not None and cfg.verify_on_commit == "async":
        checks = ThreadPoolExecutor(cfg.verify_threads, thread_name_prefix="kvstore-verify") if cfg.verify_threads \
            else copies
        verifier = CommitVerifier(store, checks)
    servicer = KvStoreServicer(store, arena, executor, copies, transfers, zero_copy=cfg.zero_copy, nixl=nixl,
                               verifier=verifier)
    server.add_generic_rpc_handlers((_handlers(servicer),))
    port = bind(server, cfg.address, cfg.internal_tls.server_credentials())
    await server.start()
    health.set_ready(True)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"kvstore listening on {host}:{port} backend={store.backend.name} capacity={cfg.capacity_bytes} "
          f"zero_copy={servicer.zero_copy} nixl={nixl.name if nixl else 'off'} windows={arena.size if arena else 0} "
          f"verify_on_commit={cfg.verify_on_commit}",
          flush=True)
    metrics_port = start_metrics_server(cfg.host, cfg.metrics_port)
    if metrics_port:
        print(f"kvstore metrics on http://{host}:{metrics_port}/metrics", flush=True)
    gauges = asyncio.create_task(metrics.refresh_gauges(store, executor))
    expiry = asyncio.create_task(_expire_every(servicer, executor, min(1.0, cfg.lease_ttl_s / 4)))
    try:
        await stop.wait()
    finally:
        gauges.cancel()
        expiry.cancel()
        health.set_ready(False, "stopping")
        await server.stop(grace=2.0)
        if verifier is not None:
            verifier.close()   # a backlog is abandoned: unchecked blocks are never spilled unchecked
        executor.shutdown(wait=False, cancel_futures=True)
        copies.shutdown(wait=False, cancel_futures=True)
        if checks is not None and checks is not copies:
            checks.shutdown(wait=False, cancel_futures=True)
        if nixl is not None:
            nixl.close()
        store.backend.close()
        if arena is not None:
            arena.close()
        log.info("stopped")
    return 0
