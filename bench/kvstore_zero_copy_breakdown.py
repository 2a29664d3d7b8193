"""Where a zero-copy kvstore transfer's time goes (docs/kvstore.md): a real kvstore process, 1 GiB
of 2 MiB blocks, the client's read_zero_copy / write_zero_copy with consumers that do nothing,
that checksum nothing (to see the protocol alone), with several chunk sizes and thread counts, and
a plain memcpy and CRC-32C of the same bytes in the same run.

    python bench/kvstore_zero_copy_breakdown.py [--gib 1] [--out bench/results/kvstore_zero_copy_breakdown.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from services.common import kv_client as kvc  # noqa: E402
from services.common.kv_blocks import checksum, kv_pb2  # noqa: E402
from services.common.ports import free_port  # noqa: E402

BLOCK = 2 << 20


def ns() -> "kv_pb2.KvNamespace":
    return kv_pb2.KvNamespace(model_id="breakdown", weights_fingerprint="x", dtype="bfloat16", kv_cache_dtype="bfloat16",
                              block_size=16, num_layers=32, tp_size=1, tp_rank=0, block_bytes=BLOCK, layout="L2BHD")


def best(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out), statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // BLOCK
    nbytes = n * BLOCK
    port = free_port()
    log = open("/tmp/kvstore-breakdown.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--capacity-gb",
                             str(args.gib * 2 + 0.5)], cwd=ROOT, stdout=log, stderr=log)
    out: dict = {"cpus": os.cpu_count(), "bytes": nbytes, "blocks": n}
    try:
        probe = kvc.KvClient(f"127.0.0.1:{port}", use_shm=False)
        deadline = time.monotonic() + 60
        while probe.stats() is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        blocks = [src[i * BLOCK:(i + 1) * BLOCK] for i in range(n)]
        dst = np.empty_like(src)
        with ThreadPoolExecutor(8) as ex:
            out["memcpy_8threads_gbps"] = nbytes / best(lambda: list(ex.map(
                lambda i: np.copyto(dst[i * BLOCK:(i + 1) * BLOCK], blocks[i]), range(n))), args.reps)[0] / 1e9
            out["crc32c_8threads_gbps"] = nbytes / best(lambda: list(ex.map(checksum, blocks)), args.reps)[0] / 1e9
        out["lookup_rpc_ms"] = min(best(lambda: probe.lookup(ns(), [b"x"]), 20)) * 1e3
        runs = []
        for chunk_mb in (32, 128, 512):
            for threads in (8, 16):
                c = kvc.KvClient(f"127.0.0.1:{port}", timeout_s=30.0, chunk_bytes=chunk_mb << 20, copy_threads=threads)
                hashes = [f"{chunk_mb}-{threads}-{i}".encode() for i in range(n)]

                def fill(start, idx, views):
                    for k, i in enumerate(idx):
                        np.copyto(np.frombuffer(views[k], dtype=np.uint8), blocks[i])

                writes = []
                for _ in range(args.reps):
                    c.flush(ns())
                    t = time.perf_counter()
                    assert c.write_zero_copy(ns(), hashes, fill) == n
                    writes.append(time.perf_counter() - t)
                r_noop = best(lambda: c.read_zero_copy(ns(), hashes, lambda s, v: None), args.reps)
                real = kvc.checksum
                kvc.checksum = lambda v: 0   # the protocol alone: every block reads as corrupt
                try:
                    r_nocrc = best(lambda: c.read_zero_copy(ns(), hashes, lambda s, v: None), args.reps)
                finally:
                    kvc.checksum = real
                runs.append({"chunk_mb": chunk_mb, "threads": threads,
                             "write_gbps": nbytes / min(writes) / 1e9,
                             "read_noop_consume_gbps": nbytes / r_noop[0] / 1e9,
                             "read_no_checksum_gbps": nbytes / r_nocrc[0] / 1e9})
                print(json.dumps(runs[-1]), flush=True)
                c.flush(ns())
                c.close()
        out["runs"] = runs
        probe.close()
    finally:
        proc.terminate()
        proc.wait(10)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
