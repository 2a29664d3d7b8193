"""KV tier transfer bandwidth: put and get of 2 MiB blocks (an 8B model's block: 32 layers x K,V
x 16 tokens x 8 KV heads x 128 x bf16) through a real kvstore process over each data plane the
client has, against a plain memcpy of the same bytes measured in the same run (the floor any
host-memory tier pays at least twice: into the store and out of it) and CRC-32 (the checksum
every block carries, computed by the writer and verified by the store and the reader).

  .venv/bin/python bench/kvstore_transfer.py [--blocks 32] [--reps 5] [--out bench/results/kvstore_transfer.json]

Data planes: "shm" (the kvstore's memfd window, services/common/kv_client.py), "grpc" (bytes in
the messages). NIXL is reported as unavailable when it does not import here (not installed)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.kv_blocks import kv_pb2  # noqa: E402
from services.common.kv_client import KvClient  # noqa: E402
from services.common.ports import free_port  # noqa: E402

BLOCK = 2 << 20


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def floor(total: int, reps: int) -> dict:
    src = bytearray(os.urandom(1 << 20)) * (total >> 20)
    dst = bytearray(total)
    mv_src, mv_dst = memoryview(src), memoryview(dst)
    copies, crcs = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for off in range(0, total, BLOCK):   # block by block, as the tier moves them
            mv_dst[off:off + BLOCK] = mv_src[off:off + BLOCK]
        copies.append(_gbps(total, time.perf_counter() - t))
        t = time.perf_counter()
        for off in range(0, total, BLOCK):
            zlib.crc32(mv_src[off:off + BLOCK])
        crcs.append(_gbps(total, time.perf_counter() - t))
    return {"memcpy_gbps": max(copies), "memcpy_gbps_median": statistics.median(copies),
            "crc32_gbps": max(crcs), "crc32_gbps_median": statistics.median(crcs)}


def start_store(capacity_gb: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--capacity-gb",
                             str(capacity_gb), "--shm-window-mb", "128", "--shm-windows", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert re.search(r"kvstore listening on", line), line
    return proc, f"127.0.0.1:{port}"


def transfer(addr: str, transport: str, n: int, reps: int) -> dict:
    ns = kv_pb2.KvNamespace(model_id=f"bench-{transport}", block_size=16, num_layers=32, tp_size=1,
                            block_bytes=BLOCK, dtype="bfloat16", kv_cache_dtype="bfloat16", layout="L2BHD")
    client = KvClient(addr, use_shm=transport == "shm", timeout_s=30.0)
    assert client.transport == transport, (client.transport, transport)
    payload = [os.urandom(BLOCK) for _ in range(n)]
    dests = [bytearray(BLOCK) for _ in range(n)]
    puts, gets = [], []
    for rep in range(reps + 1):            # rep 0 warms up (page faults of the window, the store)
        hashes = [f"{transport}-{rep}-{i}".encode() for i in range(n)]
        t = time.perf_counter()
        stored = client.put(ns, list(zip(hashes, payload)))
        dt_put = time.perf_counter() - t
        t = time.perf_counter()
        found = client.get_into(ns, hashes, dests)
        dt_get = time.perf_counter() - t
        assert stored == n and all(found), (stored, sum(found))
        assert all(bytes(d) == p for d, p in zip(dests, payload))
        if rep:
            puts.append(_gbps(n * BLOCK, dt_put))
            gets.append(_gbps(n * BLOCK, dt_get))
        client.flush(ns)
    client.close()
    return {"put_gbps": max(puts), "put_gbps_median": statistics.median(puts),
            "get_gbps": max(gets), "get_gbps_median": statistics.median(gets)}


def nixl_status() -> str:
    try:
        import nixl  # noqa: F401
    except Exception as exc:  # not installed here: the client never offers it
        return f"unavailable ({type(exc).__name__}: {exc})"[:200]
    return "importable, not wired into the kvstore (see docs/kvstore.md)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=32, help="blocks per put/get call (2 MiB each)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kvstore_transfer.json"))
    a = p.parse_args()
    total = a.blocks * BLOCK
    result = {"block_bytes": BLOCK, "blocks_per_call": a.blocks, "reps": a.reps,
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "floor": floor(total, a.reps), "transports": {}, "nixl": nixl_status()}
    proc, addr = start_store(capacity_gb=2 * total * (a.reps + 1) / (1 << 30) + 0.1)
    try:
        for transport in ("shm", "grpc"):
            result["transports"][transport] = transfer(addr, transport, a.blocks, a.reps)
    finally:
        proc.terminate()
        proc.wait(10)
    copy = result["floor"]["memcpy_gbps"]
    for t in result["transports"].values():
        t["put_vs_memcpy"] = round(t["put_gbps"] / copy, 3)
        t["get_vs_memcpy"] = round(t["get_gbps"] / copy, 3)
    fastest = max(result["transports"], key=lambda k: result["transports"][k]["get_gbps"])
    result["fastest"] = fastest
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
