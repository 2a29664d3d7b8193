"""`python -m services.kvstore [--capacity-gb N] [--disk-dir DIR --disk-gb N] [--backend redis://H:P]`.

Serves meshllm.v1.KvStore (the secondary KV tier, docs/kvstore.md) and grpc.health.v1."""
from __future__ import annotations

import argparse
import asyncio
import sys

from services.common import internal_tls, telemetry
from services.common.log import setup_logging
from services.common.metrics import add_metrics_args
from services.common.procs import install_stop_handlers
from services.kvstore.config import KvStoreConfig


def _parser() -> argparse.ArgumentParser:
    d = KvStoreConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="gRPC port (0: any free port)")
    p.add_argument("--capacity-gb", type=float, default=d["capacity_gb"].default,
                   help="host memory for KV blocks, a hard bound (LRU eviction)")
    p.add_argument("--disk-dir", default="", help="spill evicted blocks to this directory (survives restarts)")
    p.add_argument("--disk-gb", type=float, default=0.0, help="the disk tier's hard bound")
    p.add_argument("--backend", default=d["backend"].default,
                   help="'memory' (default) or redis://HOST:PORT[/DB]: blocks live in that Redis server")
    p.add_argument("--zero-copy", action=argparse.BooleanOptionalAction, default=d["zero_copy"].default,
                   help="same-host clients map the memory backend's blocks and read / write them in place")
    p.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=d["nixl"].default,
                   help="offer the memory backend's blocks over NIXL (UCX) to clients that cannot map them "
                        "(another host or container); default: on when nixl imports. UCX endpoints are not "
                        "authenticated: trusted networks only (docs/kvstore.md)")
    p.add_argument("--verify-on-commit", choices=("sync", "async"), default=d["verify_on_commit"].default,
                   help="a zero-copy Commit answers once its blocks are recorded and the store re-checks their "
                        "CRC-32C in the background, dropping a mismatch (async), or only after the check (sync)")
    p.add_argument("--verify-threads", type=int, default=d["verify_threads"].default,
                   help="threads of the async check (0: the copy threads); few, so that the checks "
                        "running beside a save do not slow its Reserve and Commit calls")
    p.add_argument("--shm-window-mb", type=int, default=d["shm_window_mb"].default,
                   help="one client's window of shared memory (the same-host plane of the Redis backend)")
    p.add_argument("--shm-windows", type=int, default=d["shm_windows"].default,
                   help="shared-memory windows (0: none)")
    p.add_argument("--lease-ttl-s", type=float, default=d["lease_ttl_s"].default,
                   help="a client's lease unused this long ends, and its pins and reserved slots with it")
    p.add_argument("--worker-threads", type=int, default=d["worker_threads"].default)
    p.add_argument("--copy-threads", type=int, default=KvStoreConfig().copy_threads,
                   help="threads that copy and checksum the blocks of one call (default: min(8, CPUs))")
    p.add_argument("--log-level", default=None)
    add_metrics_args(p)
    internal_tls.add_flags(p)
    return p


def parse_config(argv: list[str] | None) -> KvStoreConfig:
    p = _parser()
    a = p.parse_args(argv)
    try:
        return KvStoreConfig(host=a.host, port=a.port, capacity_gb=a.capacity_gb, disk_dir=a.disk_dir,
                             disk_gb=a.disk_gb, backend=a.backend, zero_copy=a.zero_copy, nixl=a.nixl,
                             verify_on_commit=a.verify_on_commit, verify_threads=a.verify_threads,
                             shm_window_mb=a.shm_window_mb,
                             shm_windows=a.shm_windows, lease_ttl_s=a.lease_ttl_s,
                             worker_threads=a.worker_threads, copy_threads=a.copy_threads, internal_tls=internal_tls.from_args(a),
                             metrics_port=a.metrics_port, log_level=a.log_level)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(telemetry.init_service("kvstore", argv))  # tracing flags + OTEL_*
    setup_logging("kvstore", cfg.log_level)

    async def run() -> int:
        from services.kvstore.serving import serve  # grpc import after the flags are valid
        stop = asyncio.Event()
        install_stop_handlers(asyncio.get_running_loop(), stop)
        return await serve(cfg, stop)

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
