"""One-H200 benchmark of the KV tiers (docs/kv_tiers.md) on a Llama-3.1-8B-shaped model (random bf16
weights, 2 MiB blocks): tier-1 host offload and load, tier-2 (a real kvstore process) save and
load, each in GB/s against a pinned host<->device copy of the same bytes measured in the same
run, and the TTFT of an 8k-token prompt recomputed vs with its prefix loaded from each tier.

  python3 bench/gpu_kv_tiers.py --out bench/results/gpu_kv_tiers.json

Drives the ModelRunner and its KvTiers in-process (the scheduler's plans built by hand through
the worker's wire edge, as bench/gpu_decode.py does); the kvstore is its own process on the same
host, reached over its shared-memory window."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_decode import BS, GREEDY, Reqs, build_model, kv_runner, llama31_8b_config, run  # noqa: E402
from services.common.kv_blocks import kv_pb2  # noqa: E402
from services.common.kv_client import KvClient  # noqa: E402
from services.common.ports import free_port  # noqa: E402
from services.worker.kv_tiers import LAYOUT, TierConfig  # noqa: E402
from services.worker.plan import TierBlocks  # noqa: E402


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, secs: list[float]) -> dict:
    return {"best_gbps": nbytes / min(secs) / 1e9, "median_gbps": nbytes / statistics.median(secs) / 1e9,
            "median_ms": statistics.median(secs) * 1e3}


def floors(nbytes: int, reps: int) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return {"h2d_pinned": gbps(nbytes, timed(lambda: dev.copy_(host, non_blocking=True), reps)),
            "d2h_pinned": gbps(nbytes, timed(lambda: host.copy_(dev, non_blocking=True), reps))}


def start_kvstore(capacity_gb: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--capacity-gb",
                             str(capacity_gb), "--shm-window-mb", "256", "--shm-windows", "4"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open("/tmp/kvstore-bench.log", "w"))
    addr = f"127.0.0.1:{port}"
    probe = KvClient(addr, use_shm=False)
    deadline = time.monotonic() + 60
    while probe.stats() is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kvstore did not start: " + open("/tmp/kvstore-bench.log").read()[-2000:])
        time.sleep(0.2)
    probe.close()
    return proc, addr


def prefill(runner, reqs: Reqs, rid: str, tokens: list[int], blocks: list[int], computed: int) -> tuple[float, int]:
    plan = reqs.plan()
    plan.new_requests.add(request_id=rid, token_ids=tokens, block_ids=blocks, num_computed_tokens=computed,
                          num_scheduled_tokens=len(tokens) - computed, sampling=GREEDY)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = run(runner, plan)
    dt = time.perf_counter() - t0
    fin = reqs.plan()
    fin.finished_ids.append(rid)
    run(runner, fin)
    return dt, res.outputs[0].token_ids[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--chunk-mb", type=int, default=0, help="the kvstore client's zero-copy chunk (0: its default)")
    ap.add_argument("--copy-threads", type=int, default=0, help="the client's checksum threads (0: its default)")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (0: Python's)")
    args = ap.parse_args()
    n_blocks = args.prompt_len // BS
    model = build_model(llama31_8b_config(), max_len=args.prompt_len + 1024)
    runner = kv_runner(model, 24.0, None)
    kv_proc, addr = start_kvstore(capacity_gb=3.0)
    try:
        if args.switch_interval:
            sys.setswitchinterval(args.switch_interval)
        client = KvClient(addr, timeout_s=10.0, **({"chunk_bytes": args.chunk_mb << 20} if args.chunk_mb else {}),
                          **({"copy_threads": args.copy_threads} if args.copy_threads else {}))

        def make_ns(block_size: int, block_bytes: int):
            return kv_pb2.KvNamespace(model_id="bench-8b", weights_fingerprint="random-seed-0", dtype="bfloat16",
                                      kv_cache_dtype="bfloat16", block_size=block_size, num_layers=32, tp_size=1,
                                      tp_rank=0, block_bytes=block_bytes, layout=LAYOUT)
        runner.enable_kv_tiers(TierConfig(offload_bytes=(n_blocks + 8) * (2 << 20), client=client, make_namespace=make_ns,
                                          load_timeout_s=60.0, save_buffer_bytes=(n_blocks + 8) * (2 << 20)))
        tiers = runner.tiers
        nbytes = n_blocks * tiers.block_bytes
        out = {"device": torch.cuda.get_device_name(), "host": platform.node(), "cpus": os.cpu_count(),
               "prompt_len": args.prompt_len, "blocks": n_blocks, "block_bytes": tiers.block_bytes,
               "bytes": nbytes, "floors": floors(nbytes, args.reps)}
        print(json.dumps(out["floors"]), flush=True)
        reqs = Reqs(runner.num_blocks)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 128000, (args.prompt_len,), generator=gen).tolist()
        src = reqs.blocks(args.prompt_len)          # the prompt's KV, computed once
        dst = reqs.blocks(args.prompt_len)          # where the tiers bring it back
        cold = [prefill(runner, reqs, f"cold{i}", tokens, src, 0) for i in range(args.reps)]
        first_token = cold[0][1]
        hashes = [i.to_bytes(8, "little") + b"bench" for i in range(n_blocks)]
        slots = list(range(n_blocks))

        # Tier 1: device -> pinned host slots, and back into other blocks.
        off = SimpleNamespace(host_offloads=list(zip(src, slots)), host_loads=[])
        load = SimpleNamespace(host_offloads=[], host_loads=list(zip(dst, slots)))
        out["host_offload"] = gbps(nbytes, timed(lambda: tiers.apply_host_copies(off), args.reps))
        out["host_load"] = gbps(nbytes, timed(lambda: tiers.apply_host_copies(load), args.reps))
        same = all(torch.equal(c[:, src[:-1]], c[:, dst[:-1]]) for c in runner.kv_caches)

        firsts: dict[str, list[int]] = {"host": [], "kvstore": []}

        def warm_prefill(label: str, i: int) -> float:
            dt, tok = prefill(runner, reqs, f"{label}{i}", tokens, dst, args.prompt_len - BS)
            firsts[label].append(tok)
            return dt

        host_ttft = []
        for i in range(args.reps):
            t0 = time.perf_counter()
            tiers.apply_host_copies(load)
            host_ttft.append(time.perf_counter() - t0 + warm_prefill("host", i))

        # Tier 2: save through the kvstore (gather + D2H + put), then fetch into other blocks.
        def save():
            tiers.save([TierBlocks("s", src[:-1], hashes[:-1])])
            assert tiers.flush_saves(120.0)
            tiers.take_saves()   # as the runner's collect does
        save_secs = []
        for _ in range(args.reps):
            client.flush(tiers.namespace)   # every rep stores the blocks anew
            save_secs += timed(save, 1)
        out["kvstore_save"] = gbps(nbytes - tiers.block_bytes, save_secs)
        stored = client.lookup(tiers.namespace, hashes[:-1])

        def fetch():
            tiers.start_loads([TierBlocks("l", dst[:-1], hashes[:-1])])
            got = []
            while not got:
                got = tiers.take_loads(1.0)
            assert got[0].num_loaded == n_blocks - 1, got
        for c in runner.kv_caches:
            c[:, dst].zero_()
        out["kvstore_load"] = gbps(nbytes - tiers.block_bytes, timed(fetch, args.reps))
        same_tier = all(torch.equal(c[:, src[:-1]], c[:, dst[:-1]]) for c in runner.kv_caches)
        tier_ttft = []
        for i in range(args.reps):
            t0 = time.perf_counter()
            fetch()
            tier_ttft.append(time.perf_counter() - t0 + warm_prefill("kvstore", i))
        # Where a kvstore load's time goes: the client's get into pinned staging alone.
        staging = torch.empty((64, *tiers.block_shape), dtype=torch.uint8, pin_memory=True)
        dests = [b.numpy() for b in staging.unbind(0)]
        get_secs = timed(lambda: [client.get_into(tiers.namespace, hashes[i:i + 64], dests[:len(hashes[i:i + 64])])
                                  for i in range(0, n_blocks - 1, 64)], args.reps)
        out["kvstore_get_only"] = gbps(nbytes - tiers.block_bytes, get_secs)
        floor = out["floors"]["h2d_pinned"]["best_gbps"]
        out["ratios_vs_pinned_h2d"] = {k: out[k]["best_gbps"] / floor for k in
                                       ("host_offload", "host_load", "kvstore_save", "kvstore_load", "kvstore_get_only")}
        cold_ms = statistics.median(dt for dt, _ in cold) * 1e3
        out["ttft_ms"] = {"recompute": cold_ms, "host_tier": statistics.median(host_ttft) * 1e3,
                          "kvstore_tier": statistics.median(tier_ttft) * 1e3}
        out["ttft_ratio_vs_recompute"] = {k: v / cold_ms for k, v in out["ttft_ms"].items()}
        out["checks"] = {"host_bytes_identical": same, "kvstore_bytes_identical": same_tier,
                         "kvstore_blocks_stored": stored, "first_token_recompute": first_token,
                         "first_tokens_after_loads": firsts}
        out["kvstore_stats"] = str(client.stats()).replace("\n", " ")[:2000]
        if tiers.store_io is not None:   # seconds in the worker's own copies vs whole zero-copy calls
            out["store_io_stats"] = dict(tiers.store_io.stats)
        print(json.dumps({k: v for k, v in out.items() if k != "kvstore_stats"}, indent=1), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
        client.close()
    finally:
        kv_proc.terminate()
        kv_proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
