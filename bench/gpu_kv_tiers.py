"""One-H200 benchmark of the KV tiers (docs/kv_tiers.md) on a Llama-3.1-8B-shaped model (random bf16
weights, 2 MiB blocks): tier-1 host offload and load, tier-2 (a real kvstore process) save and
load, each in GB/s against a pinned host<->device copy of the same bytes measured in the same
run, and the TTFT of an 8k-token prompt recomputed vs with its prefix loaded from each tier.

  python3 bench/gpu_kv_tiers.py --out bench/results/gpu_kv_tiers.json
  python3 bench/gpu_kv_tiers.py --variants cpu,gpu:r256,gpu:w256:f0 --out ...   # tier 2 again per variant

A variant is CHECKSUMS[:rMIB][:wMIB][:fMIB][:tMIB][:cN]: the tier-2 save and load measured again in the
same process with the block checksums on the GPU (kv_block_crc.py, the default) or on the
client's CPU threads, and the client's zero-copy chunks changed (r: a Pin, w: a Reserve, f: a
save's first Reserve, t: its last, c: commits in flight); each reports its ratios and where its seconds went
(the worker's copies, the client's stages).

Tier-2 saves are timed two ways: from the call with the data already on the device ("save"), and
as the worker saves, called right behind the step's forward (a GPU spin stands in for it) and timed
from the data being ready ("save_behind_forward": the first Reserve's round trip overlaps the
forward, as it does in the engine).

The kvstore checks a zero-copy save's blocks after its Commits answer (--verify-on-commit async,
its default; --store-verify-on-commit sync: before): every save rep is followed, untimed, by
--settle-ms for that check to finish before the next rep flushes the blocks, so no rep's check
is skipped or overlaps the next rep's copies.

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


# torch.cuda._sleep spins this many cycles a second (the H200's SM clock under load, ~1.98 GHz);
# only the spin's measured end (an event) enters the timing, so the rate need not be exact.
SPIN_HZ = 1.98e9


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


def crc_probe(crc, block_bytes: int, n_blocks: int, reps: int) -> dict:
    """The GPU checksum (kv_block_crc.py) against the CPU's on random blocks, and its GB/s."""
    if crc is None:
        return {"available": False}
    import crc32c
    blocks = torch.randint(0, 256, (n_blocks, block_bytes), dtype=torch.uint8, device="cuda")
    got = [v & 0xFFFFFFFF for v in crc(blocks[:8]).tolist()]
    want = [crc32c.crc32c(blocks[i].cpu().numpy()) for i in range(8)]
    return {"available": True, "matches_cpu": got == want, "seg_words": crc.seg_words,
            **gbps(blocks.numel(), timed(lambda: crc(blocks), reps))}


def host_probes(client, tiers, io, nbytes: int) -> dict:
    """What a save's store-side check and a call's round trip cost here, alone: CRC-32C of the
    arena's stored bytes (as the kvstore's commit does, 8 threads) vs of private memory, and
    the median Lookup."""
    from concurrent.futures import ThreadPoolExecutor

    import crc32c
    import numpy as np
    out = {}
    bb = tiers.block_bytes
    arenas = [t for _, size, t, _ in io.maps._maps.values() if size >= nbytes] if io is not None else []
    private = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    with ThreadPoolExecutor(8) as ex:
        for name, arr in (("private", private), *((("arena", arenas[0][:nbytes].numpy()),) if arenas else ())):
            views = [memoryview(arr[i:i + bb]) for i in range(0, nbytes, bb)]
            list(ex.map(crc32c.crc32c, views))
            t0 = time.perf_counter()
            list(ex.map(crc32c.crc32c, views))
            out[f"crc32c_8_threads_{name}_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
    secs = []
    for _ in range(30):
        t0 = time.perf_counter()
        client.lookup(tiers.namespace, [b"probe"])
        secs.append(time.perf_counter() - t0)
    out["lookup_rpc_ms_median"] = statistics.median(secs) * 1e3
    return out


def start_kvstore(capacity_gb: float, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--capacity-gb",
                             str(capacity_gb), "--shm-window-mb", "256", "--shm-windows", "4", *extra], cwd=ROOT,
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
    ap.add_argument("--variants", default="", help="CHECKSUMS[:rMIB][:wMIB][:fMIB][:tMIB][:cN],... (gpu or cpu): tier 2 again")
    ap.add_argument("--store-copy-threads", type=int, default=0, help="the kvstore's --copy-threads (0: its default)")
    ap.add_argument("--store-verify-on-commit", default="", choices=("", "sync", "async"),
                    help="the kvstore's --verify-on-commit ('': its default, async)")
    ap.add_argument("--store-args", default="", help="more flags for the kvstore, e.g. '--verify-threads 8'")
    ap.add_argument("--settle-ms", type=float, default=250.0,
                    help="untimed pause after each save rep: the store's check of that save finishes")
    ap.add_argument("--store-log-level", default="", help="the kvstore's --log-level (debug: its per-call timings)")
    args = ap.parse_args()
    n_blocks = args.prompt_len // BS
    model = build_model(llama31_8b_config(), max_len=args.prompt_len + 1024)
    runner = kv_runner(model, 24.0, None)
    extra = (["--copy-threads", str(args.store_copy_threads)] if args.store_copy_threads else []) + \
        (["--log-level", args.store_log_level] if args.store_log_level else []) + \
        (["--verify-on-commit", args.store_verify_on_commit] if args.store_verify_on_commit else []) + \
        args.store_args.split()
    kv_proc, addr = start_kvstore(capacity_gb=3.0, extra=extra)
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
               "store_verify_on_commit": args.store_verify_on_commit or "async", "store_args": args.store_args,
               "settle_ms": args.settle_ms,
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
        io = tiers.store_io
        gpu_crc = io.crc if io is not None else None
        out["gpu_checksum"] = crc_probe(gpu_crc, tiers.block_bytes, n_blocks, args.reps)

        def save():
            tiers.save([TierBlocks("s", src[:-1], hashes[:-1])])
            assert tiers.flush_saves(120.0)
            tiers.take_saves()   # as the runner's collect does

        def save_behind_forward(forward_ms: float = 20.0) -> float:
            """As the worker saves: called right behind a step's forward (a GPU spin of forward_ms
            stands in for it), so the first Reserve overlaps the forward -> seconds from the data
            being ready (the spin's end) to the blocks being in the store."""
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            torch.cuda._sleep(int(forward_ms * 1e-3 * SPIN_HZ))
            e1.record()
            save()
            done = time.perf_counter()
            e1.synchronize()
            return done - (t0 + e0.elapsed_time(e1) / 1e3)

        def fetch():
            tiers.start_loads([TierBlocks("l", dst[:-1], hashes[:-1])])
            got = []
            while not got:
                got = tiers.take_loads(1.0)
            assert got[0].num_loaded == n_blocks - 1, got

        zc = client._zero_copy
        defaults = (zc.read_chunk_bytes, zc.chunk_bytes, zc.first_write_bytes, zc.last_write_bytes, zc.commits_in_flight)

        def tier2(spec: str) -> dict:
            checksums, *knobs = spec.split(":")
            if io is not None:
                io.crc = gpu_crc if checksums == "gpu" else None
            zc.read_chunk_bytes, zc.chunk_bytes, zc.first_write_bytes, zc.last_write_bytes, zc.commits_in_flight = defaults
            for k in knobs:
                v = int(k[1:])
                if k[0] == "r":
                    zc.read_chunk_bytes = v << 20
                elif k[0] == "w":
                    zc.chunk_bytes = v << 20
                elif k[0] == "f":
                    zc.first_write_bytes = v << 20
                elif k[0] == "t":
                    zc.last_write_bytes = v << 20
                elif k[0] == "c":
                    zc.commits_in_flight = v
            before_io, before_client = dict(io.stats) if io else {}, client.transfer_stats
            save_secs, behind_secs = [], []
            for _ in range(args.reps):
                client.flush(tiers.namespace)   # every rep stores the blocks anew
                save_secs += timed(save, 1)
                time.sleep(args.settle_ms / 1e3)
                client.flush(tiers.namespace)
                behind_secs.append(save_behind_forward())
                time.sleep(args.settle_ms / 1e3)
            stored = client.lookup(tiers.namespace, hashes[:-1])
            mid_io, mid_client = dict(io.stats) if io else {}, client.transfer_stats
            for c in runner.kv_caches:
                c[:, dst].zero_()
            load = gbps(nbytes - tiers.block_bytes, timed(fetch, args.reps))
            same = all(torch.equal(c[:, src[:-1]], c[:, dst[:-1]]) for c in runner.kv_caches)
            after_io, after_client = dict(io.stats) if io else {}, client.transfer_stats

            def per_rep(a: dict, b: dict) -> dict:   # seconds per rep of each stage
                return {k: (b.get(k, 0) - a.get(k, 0)) / args.reps for k in sorted(b) if b.get(k, 0) != a.get(k, 0)}
            return {"checksums": checksums if io is not None and gpu_crc is not None else "cpu",
                    "read_chunk_mib": zc.read_chunk_bytes >> 20, "write_chunk_mib": zc.chunk_bytes >> 20,
                    "first_write_mib": zc.first_write_bytes >> 20,
                    "last_write_mib": zc.last_write_bytes >> 20, "commits_in_flight": zc.commits_in_flight,
                    "save": gbps(nbytes - tiers.block_bytes, save_secs),
                    # from the data being ready, the save called behind a forward (the worker's way)
                    "save_behind_forward": gbps(nbytes - tiers.block_bytes, behind_secs),
                    "load": load, "blocks_stored": stored, "bytes_identical": same,
                    "save_stages_s": {**per_rep(before_io, mid_io), **per_rep(before_client, mid_client)},
                    "load_stages_s": {**per_rep(mid_io, after_io), **per_rep(mid_client, after_client)}}

        if args.chunk_mb:
            zc.chunk_bytes = zc.read_chunk_bytes = args.chunk_mb << 20
            defaults = (zc.read_chunk_bytes, zc.chunk_bytes, zc.first_write_bytes, zc.last_write_bytes, zc.commits_in_flight)
        first = tier2("gpu")
        out["kvstore_save"], out["kvstore_load"] = first["save"], first["load"]
        out["kvstore_save_behind_forward"] = first["save_behind_forward"]
        out["kvstore_stages"] = first
        stored, same_tier = first["blocks_stored"], first["bytes_identical"]
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
                                       ("host_offload", "host_load", "kvstore_save", "kvstore_save_behind_forward",
                                        "kvstore_load", "kvstore_get_only")}
        out["variants"] = {}
        out["probes"] = host_probes(client, tiers, io, nbytes)
        for spec in filter(None, args.variants.split(",")):
            v = tier2(spec)
            v["ratios_vs_pinned_h2d"] = {"save": v["save"]["best_gbps"] / floor, "load": v["load"]["best_gbps"] / floor,
                                         "save_behind_forward": v["save_behind_forward"]["best_gbps"] / floor}
            out["variants"][spec] = v
            print(spec, json.dumps(v["ratios_vs_pinned_h2d"]), flush=True)
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
