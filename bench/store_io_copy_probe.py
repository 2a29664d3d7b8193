"""The worker's half of a zero-copy kvstore load (services/worker/kv_store_io.py) alone, on a GPU:
1 GiB of 2 MiB blocks (8B shape) in a registered memfd mapping copied into the KV cache in the
staging chunks a load uses, split into its parts (the host-to-device copies, the scatter), against
one copy of the whole GiB in the same run.

    python3 bench/store_io_copy_probe.py [--out bench/results/store_io_copy_probe.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.worker.kv_store_io import StoreIO  # noqa: E402
from services.worker.kv_tiers import KvTiers, TierConfig  # noqa: E402


class _NoClient:
    def set_arena_hooks(self, on_map, on_unmap) -> None:
        pass


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    layers, nblocks = 32, 600
    caches = [torch.zeros((2, nblocks, 16, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    tiers = KvTiers(caches, 16, TierConfig())
    bb = tiers.block_bytes
    n = 512
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, n * bb)
    mm = mmap.mmap(fd, n * bb)
    os.close(fd)
    io = StoreIO(_NoClient(), tiers.block_shape, tiers.device, tiers.scatter)
    io.maps.on_map(mm)
    whole = io.maps.tensor_at(io.maps.runs([memoryview(mm)[:bb]], bb)[0][2].data_ptr(), n * bb)
    whole.fill_(7)
    views = [memoryview(mm)[i * bb:(i + 1) * bb].toreadonly() for i in range(n)]
    dst = list(range(1, n + 1))
    dev = torch.empty(n * bb, dtype=torch.uint8, device="cuda")
    per = io.per_chunk
    out = {"block_bytes": bb, "blocks": n, "per_chunk": per}
    out["h2d_whole_gbps"] = n * bb / timed(lambda: dev.copy_(whole, non_blocking=True)) / 1e9

    out["copy_in_per_chunk_gbps"] = n * bb / timed(lambda: [io._copy_in(dst[c:c + per], views[c:c + per])
                                                             for c in range(0, n, per)]) / 1e9
    out["copy_in_whole_gbps"] = n * bb / timed(lambda: io._copy_in(dst, views)) / 1e9   # two stagings alternate

    staging = torch.empty((per, *tiers.block_shape), dtype=torch.uint8, device="cuda")
    flat = staging.view(-1)

    def dma_only():
        with torch.cuda.stream(io._load_stream):
            for c in range(0, n, per):
                for first, count, t in io.maps.runs(views[c:c + per], bb):
                    flat[first * bb:(first + count) * bb].copy_(t, non_blocking=True)
        io._load_stream.synchronize()
    out["dma_only_chunked_gbps"] = n * bb / timed(dma_only) / 1e9

    def scatter_only():
        for c in range(0, n, per):
            tiers.scatter(dst[c:c + per], staging)
    out["scatter_only_gbps"] = n * bb / timed(scatter_only) / 1e9
    t = time.perf_counter()
    for c in range(0, n, per):
        io.maps.runs(views[c:c + per], bb)
    out["runs_host_ms"] = (time.perf_counter() - t) * 1e3
    out["runs_per_chunk"] = len(io.maps.runs(views[:per], bb))
    ok = all(torch.all(c[:, 1:n + 1].view(torch.uint8) == 7).item() for c in caches[:2])
    out["bytes_landed"] = ok
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
