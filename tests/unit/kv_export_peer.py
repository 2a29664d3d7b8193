"""Both ends of a direct hand-off for test_worker_kv_export.py, each in its own process (NIXL is
loaded only in these, never in the test process: tests/unit/test_worker_kv_export.py says why).

    python -m tests.unit.kv_export_peer prefill PORTFILE DONEFILE TRANSPORT [DEVICE]
        an exported cache (CPU, or cuda: CUDA IPC) with seeded random values, served by
        WorkerControl.ExportKv
    python -m tests.unit.kv_export_peer decode ADDR TRANSPORT [DEVICE]
        copies 4 blocks of the peer at ADDR through KvTiers, checks them against a plain mapping
        of the peer's cache, prints a JSON line and exits 0 when they match"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from services.common import pb
from services.common.ports import free_port
from services.worker.kv_export import ExportedCache, Peers

SHAPE = (2, 20, 4, 3, 8)
LOCAL_SHAPE = (2, 16, 4, 3, 8)
LAYERS = 3
SRC, DST = [3, 4, 11, 19], [0, 7, 8, 15]


class _Export(pb.control_grpc.WorkerControlServicer):
    def __init__(self, cache) -> None:
        self.cache = cache

    def ExportKv(self, request, context):
        return self.cache.describe()


def prefill(portfile: Path, donefile: Path, transport: str, device: str = "cpu") -> int:
    cache = ExportedCache(LAYERS, SHAPE, torch.float32, torch.device(device), nixl=transport != "mmap")
    g = torch.Generator().manual_seed(3)
    for layer in cache.layers:
        layer.copy_(torch.randn(SHAPE, generator=g).to(device))
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


def decode(addr: str, transport: str, device: str = "cpu") -> int:
    from services.worker.kv_tiers import KvTiers, TierConfig
    from services.worker.plan import TierBlocks
    local = ExportedCache(LAYERS, LOCAL_SHAPE, torch.float32, torch.device(device), nixl=transport != "mmap")
    tiers = KvTiers(local.layers, 4, TierConfig(direct=True, direct_transport=transport), local)
    tiers.start_loads([TierBlocks("r", DST, [], addr, SRC)])
    got = []
    for _ in range(400):
        got = tiers.take_loads(0.05)
        if got:
            break
    peers = Peers(None, LOCAL_SHAPE, torch.float32, torch.device(device), transport="mmap")
    truth = peers.get(addr)
    same = all(torch.equal(mine[:, DST], theirs[:, SRC]) for mine, theirs in zip(local.layers, truth.layers))
    untouched = not any(mine[:, 1].any() for mine in local.layers)
    loaded = got[0].num_loaded if got else -1
    via = "nixl" if any(p.nixl_remote for p in tiers.peers._peers.values()) else "mmap"
    print(json.dumps({"loaded": loaded, "same": same, "untouched": untouched, "via": via,
                      "nixl_local": local.agent is not None}), flush=True)
    peers.close()
    tiers.close()
    return 0 if loaded == len(SRC) and same and untouched else 1


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        code = prefill(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
    else:
        code = decode(sys.argv[2], sys.argv[3], *sys.argv[4:5])
    # Exit without interpreter finalization: a library thread still alive then (gRPC's, UCX's)
    # can abort the process ("terminate called without an active exception") after the work
    # is done and reported, which is not what these tests are about.
    sys.stdout.flush()
    os._exit(code)
