"""KV tier transfer bandwidth: put and get of 2 MiB blocks (an 8B model's block: 32 layers x K,V
x 16 tokens x 8 KV heads x 128 x bf16) through a real kvstore process (memory backend) over each
data plane the client has, side by side in one run, against a plain memcpy of the same bytes
measured in the same run (the floor any host-memory tier pays at least twice: into the store and
out of it) and CRC-32C (the checksum every block carries, computed by the writer and verified by
the store and the reader).

  .venv/bin/python bench/kvstore_transfer.py [--blocks 32] [--reps 5] [--out bench/results/kvstore_transfer.json]

Data planes (KvClient(data_plane=...), services/common/kv_client.py): "arena" (zero copy: the
store's block memory mapped here, Pin/Reserve + copies in place), "nixl" (the same Pin/Reserve,
the bytes moved by NIXL READ / WRITE through the client's registered staging buffer: what a
client on another host uses), "shm" (a leased window: the store copies), "grpc" (bytes in the
messages). Every plane's bytes are checked end to end (CRC-32C) and compared here. Beside them,
NIXL's raw UCX READ and WRITE of the same bytes between two processes (registered DRAM, no
checksum, no RPC), the transport's own ceiling on this host."""
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.kv_blocks import checksum, kv_pb2  # noqa: E402
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
            checksum(mv_src[off:off + BLOCK])
        crcs.append(_gbps(total, time.perf_counter() - t))
    return {"memcpy_gbps": max(copies), "memcpy_gbps_median": statistics.median(copies),
            "crc32c_gbps": max(crcs), "crc32c_gbps_median": statistics.median(crcs)}


def start_store(capacity_gb: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--capacity-gb",
                             str(capacity_gb), "--shm-window-mb", "128", "--shm-windows", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:                   # NIXL's own log lines come first
        if re.search(r"kvstore listening on", line):
            assert "nixl=off" not in line, line
            return proc, f"127.0.0.1:{port}"
    proc.kill()
    raise RuntimeError(f"the kvstore did not start (exit {proc.wait()})")


def transfer(addr: str, transport: str, n: int, reps: int) -> dict:
    ns = kv_pb2.KvNamespace(model_id=f"bench-{transport}", block_size=16, num_layers=32, tp_size=1,
                            block_bytes=BLOCK, dtype="bfloat16", kv_cache_dtype="bfloat16", layout="L2BHD")
    plane = {"arena": "zero_copy"}.get(transport, transport)
    client = KvClient(addr, data_plane=plane, timeout_s=30.0)
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


def nixl_role(role: str, d: str, n: int) -> None:
    """One side of the NIXL probe (a subprocess): the "store" registers n blocks and publishes its
    agent metadata and its buffer's address in `d` (no pickled descriptors: the client builds the
    remote list from the address); the "client" READs and WRITEs them, then says done."""
    import numpy as np
    from services.common.kv_nixl import nixl_api
    api = nixl_api()
    agent = api.nixl_agent(role, api.nixl_agent_config(backends=["UCX"]))
    buf = np.frombuffer(os.urandom(n * BLOCK), dtype=np.uint8).copy() if role == "store" else np.zeros(n * BLOCK, np.uint8)
    agent.register_memory([(buf.ctypes.data, n * BLOCK, 0, "")], "DRAM")
    descs = agent.get_xfer_descs([(buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")
    path = Path(d)
    if role == "store":
        for name, data in (("meta", agent.get_agent_metadata()), ("addr", str(buf.ctypes.data).encode()),
                           ("sum", str(int(buf.sum())).encode())):
            (path / f"{name}.tmp").write_bytes(data)
            os.replace(path / f"{name}.tmp", path / name)
        while not (path / "done").exists():
            time.sleep(0.02)
        return
    while not (path / "sum").exists():
        time.sleep(0.02)
    remote_agent = agent.add_remote_agent((path / "meta").read_bytes())
    base = int((path / "addr").read_text())
    remote = agent.get_xfer_descs([(base + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")
    out = {}
    for op in ("READ", "WRITE"):
        rates = []
        for rep in range(6):
            t = time.perf_counter()
            handle = agent.initialize_xfer(op, descs, remote, remote_agent)
            agent.transfer(handle)
            while (state := agent.check_xfer_state(handle)) != "DONE":
                assert state != "ERR", state
            if rep:
                rates.append(_gbps(n * BLOCK, time.perf_counter() - t))
            agent.release_xfer_handle(handle)
        out[f"{op.lower()}_gbps"] = max(rates)
        out[f"{op.lower()}_gbps_median"] = statistics.median(rates)
        if op == "READ":
            out["read_bytes_verified"] = int(buf.sum()) == int((path / "sum").read_text())
    (path / "result.json").write_text(json.dumps(out))
    (path / "done").write_text("1")


def nixl_probe(nixl_site: str, n: int) -> dict | str:
    import tempfile
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (nixl_site, os.environ.get("PYTHONPATH", "")) if p)}
    check = subprocess.run([sys.executable, "-c", "from services.common.kv_nixl import nixl_api; nixl_api()"],
                           env=env, cwd=ROOT, capture_output=True, text=True)
    if check.returncode:
        return f"unavailable: nixl does not import ({check.stderr.strip().splitlines()[-1][:160] if check.stderr else ''})"
    with tempfile.TemporaryDirectory() as d:
        me = [sys.executable, __file__, "--blocks", str(n), "--nixl-role"]
        store = subprocess.Popen([*me, "store", d], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            subprocess.run([*me, "client", d], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=120, check=True)
            store.wait(30)
            return {"transport": "UCX, two processes, registered DRAM, no checksum",
                    **json.loads((Path(d) / "result.json").read_text())}
        finally:
            if store.poll() is None:
                store.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=32, help="blocks per put/get call (2 MiB each)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kvstore_transfer.json"))
    p.add_argument("--nixl-site", default="", help="a folder holding nixl (pip install --target); '' = the venv's")
    p.add_argument("--nixl-role", nargs=2, metavar=("ROLE", "DIR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.nixl_role:
        nixl_role(a.nixl_role[0], a.nixl_role[1], a.blocks)
        return 0
    total = a.blocks * BLOCK
    result = {"block_bytes": BLOCK, "blocks_per_call": a.blocks, "reps": a.reps,
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "floor": floor(total, a.reps), "transports": {}, "nixl": nixl_probe(a.nixl_site, a.blocks)}
    proc, addr = start_store(capacity_gb=2 * total * (a.reps + 1) / (1 << 30) + 0.1)
    try:
        for transport in ("arena", "nixl", "shm", "grpc"):
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
