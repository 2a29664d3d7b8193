"""A peer worker for test_worker_kv_export.py: an exported CPU KV cache (memfd + NIXL agent) filled
with seeded random values, served by WorkerControl.ExportKv until told to stop.

    python -m tests.unit.kv_export_peer PORTFILE DONEFILE"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from services.common import pb
from services.common.ports import free_port
from services.worker.kv_export import ExportedCache

SHAPE = (2, 20, 4, 3, 8)
LAYERS = 3


class _Export(pb.control_grpc.WorkerControlServicer):
    def __init__(self, cache) -> None:
        self.cache = cache

    def ExportKv(self, request, context):
        return self.cache.describe()


def main() -> int:
    portfile, donefile = Path(sys.argv[1]), Path(sys.argv[2])
    cache = ExportedCache(LAYERS, SHAPE, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for layer in cache.layers:
        layer.copy_(torch.randn(SHAPE, generator=g))
    server = grpc.server(ThreadPoolExecutor(2))
    pb.control_grpc.add_WorkerControlServicer_to_server(_Export(cache), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    portfile.write_text(f"{port} {int(cache.agent is not None)}")
    deadline = time.monotonic() + 120
    while not donefile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
