"""What host memory can do on this machine, for the kvstore's data plane (docs/kv_tiers.md):
checksum and copy rates over 2 MiB blocks on 1..N threads, and DMA between the GPU and a
shared-memory (memfd) mapping registered with CUDA, against torch's own pinned memory, alone
and with checksum threads reading the same memory at the same time.

    python bench/host_copy_probe.py [--gib 1] [--out bench/results/host_copy_probe.json]

CPU-only machines get the first part."""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK = 2 << 20


def _rate(fn, blocks, threads: int, reps: int = 3) -> float:
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(fn, blocks[:threads]))
        for _ in range(reps):
            t = time.perf_counter()
            list(ex.map(fn, blocks))
            best = max(best, len(blocks) * BLOCK / (time.perf_counter() - t) / 1e9)
    return best


def cpu_part(nbytes: int, thread_counts: list[int]) -> dict:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    blocks = [src[i:i + BLOCK] for i in range(0, nbytes, BLOCK)]
    pairs = [(dst[i:i + BLOCK], src[i:i + BLOCK]) for i in range(0, nbytes, BLOCK)]
    fns = {"zlib_crc32": lambda b: zlib.crc32(b)}
    try:
        import crc32c
        fns["crc32c"] = lambda b: crc32c.crc32c(b)
    except ImportError:
        pass
    out: dict = {}
    for name, fn in fns.items():
        out[name] = {t: _rate(fn, blocks, t) for t in thread_counts}
    out["np_copy"] = {t: _rate(lambda p: np.copyto(p[0], p[1]), pairs, t) for t in thread_counts}
    return out


def _memfd_map(nbytes: int):
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr[:] = 1   # fault every page in
    return mm, arr


def _timed_gpu(fn, reps: int = 5) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def gpu_part(nbytes: int, crc_threads: int) -> dict:
    import torch
    cudart = torch.cuda.cudart()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out: dict = {}
    s = _timed_gpu(lambda: dev.copy_(pinned, non_blocking=True))
    out["h2d_torch_pinned_gbps"] = nbytes / s / 1e9
    s = _timed_gpu(lambda: pinned.copy_(dev, non_blocking=True))
    out["d2h_torch_pinned_gbps"] = nbytes / s / 1e9
    mm, arr = _memfd_map(nbytes)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    t = time.perf_counter()
    rc = cudart.cudaHostRegister(ptr, nbytes, 0)
    out["register_s"] = time.perf_counter() - t
    out["register_rc"] = int(rc) if not isinstance(rc, tuple) else int(rc[0])
    host = torch.frombuffer(mm, dtype=torch.uint8)
    out["registered_is_pinned"] = bool(host.is_pinned())
    s = _timed_gpu(lambda: dev.copy_(host, non_blocking=True))
    out["h2d_memfd_registered_gbps"] = nbytes / s / 1e9
    s = _timed_gpu(lambda: host.copy_(dev, non_blocking=True))
    out["d2h_memfd_registered_gbps"] = nbytes / s / 1e9
    blocks = [arr[i:i + BLOCK] for i in range(0, nbytes, BLOCK)]
    with ThreadPoolExecutor(crc_threads) as ex:
        def both():
            dev.copy_(host, non_blocking=True)
            list(ex.map(zlib.crc32, blocks))
        s = _timed_gpu(both)
        out["h2d_plus_crc_gbps"] = nbytes / s / 1e9
        s = _timed_gpu(lambda: list(ex.map(zlib.crc32, blocks)))
        out["crc_alone_gbps"] = nbytes / s / 1e9
        try:
            import crc32c
        except ImportError:
            crc32c = None
        if crc32c is not None:
            # The kvstore's zero-copy load: the DMA and the reader's CRC-32C read the same host
            # memory at once. Does host memory bandwidth hold both?
            s = _timed_gpu(lambda: list(ex.map(crc32c.crc32c, blocks)))
            out["crc32c_alone_gbps"] = nbytes / s / 1e9
            s = _timed_gpu(lambda: dev.copy_(host, non_blocking=True))
            out["h2d_alone_gbps"] = nbytes / s / 1e9

            def dma_and_crc32c():
                dev.copy_(host, non_blocking=True)
                list(ex.map(crc32c.crc32c, blocks))
            s = _timed_gpu(dma_and_crc32c)
            out["h2d_plus_crc32c_gbps"] = nbytes / s / 1e9
    # Chunked H2D (what a pipelined load does): 64 MiB pieces back to back.
    chunk = 64 << 20

    def chunks():
        for i in range(0, nbytes, chunk):
            dev[i:i + chunk].copy_(host[i:i + chunk], non_blocking=True)
    s = _timed_gpu(chunks)
    out["h2d_memfd_64mib_chunks_gbps"] = nbytes / s / 1e9
    del host
    cudart.cudaHostUnregister(ptr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--out", default="bench/results/host_copy_probe.json")
    args = ap.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // BLOCK * BLOCK
    cpus = os.cpu_count() or 1
    counts = sorted({1, 2, 4, 8, 16, cpus} & set(range(1, cpus + 1)))
    result = {"cpus": cpus, "bytes": nbytes, "cpu": cpu_part(nbytes, counts)}
    try:
        import torch
        if torch.cuda.is_available():
            result["device"] = torch.cuda.get_device_name()
            result["gpu"] = gpu_part(nbytes, min(8, cpus))
    except ImportError:
        pass
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
