"""One-H200 benchmark of the direct prefill->decode hand-off (docs/pd.md) for the 8B shape: two
worker processes on the same GPU, the prefill one exporting its KV cache over CUDA IPC
(services/worker/kv_export.py), the decode one copying an 8k-token prompt's blocks out of it,
against a device-to-device copy of the same bytes inside one process measured in the same run;
and the time from the prefill's first token to the decode engine's first step.

  python3 bench/gpu_pd_handoff.py --out bench/results/gpu_pd_handoff.json

The parent is the decode side; it starts the prefill side as a child (`--role prefill`), which
computes the prompt, samples the first token, serves WorkerControl.ExportKv on a local port and
waits. Both build the same seeded random weights."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.gpu_decode import BS, GREEDY, Reqs, build_model, llama31_8b_config, run  # noqa: E402
from services.common import pb  # noqa: E402
from services.common.ports import free_port  # noqa: E402
from services.worker.kv_tiers import KvTiers, TierConfig  # noqa: E402
from services.worker.plan import TierBlocks  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402


class _Export(pb.control_grpc.WorkerControlServicer):
    def __init__(self, describe) -> None:
        self.describe = describe

    def ExportKv(self, request, context):
        return self.describe()


def prefill_side(args) -> int:
    model = build_model(llama31_8b_config(), max_len=args.prompt_len + 1024)
    runner = ModelRunner(model, model_name="bench-8b", kv_cache_bytes=int(24 * 2**30), block_size=BS, export_kv=True)
    runner.hello(BS)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128000, (args.prompt_len,), generator=gen).tolist()
    reqs = Reqs(runner.num_blocks)
    blocks = reqs.blocks(args.prompt_len)
    plan = reqs.plan()
    plan.new_requests.add(request_id="p", token_ids=tokens, block_ids=blocks, num_scheduled_tokens=args.prompt_len,
                          sampling=GREEDY)
    res = run(runner, plan)
    first_ns = time.time_ns()
    server = grpc.server(ThreadPoolExecutor(2))
    pb.control_grpc.add_WorkerControlServicer_to_server(_Export(runner.exported.describe), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    Path(args.handshake).write_text(json.dumps({"addr": f"127.0.0.1:{port}", "blocks": blocks, "tokens": tokens,
                                                "first_token": res.outputs[0].token_ids[0], "first_ns": first_ns}))
    while not Path(args.handshake + ".done").exists():
        time.sleep(0.05)
    server.stop(0)
    return 0


def decode_side(args) -> int:
    handshake = tempfile.mktemp(suffix=".json")
    child = subprocess.Popen([sys.executable, __file__, "--role", "prefill", "--handshake", handshake,
                              "--prompt-len", str(args.prompt_len)], cwd=ROOT)
    try:
        model = build_model(llama31_8b_config(), max_len=args.prompt_len + 1024)
        runner = ModelRunner(model, model_name="bench-8b", kv_cache_bytes=int(24 * 2**30), block_size=BS)
        runner.hello(BS)
        runner.enable_kv_tiers(TierConfig(direct=True, load_timeout_s=60.0))
        tiers: KvTiers = runner.tiers
        deadline = time.monotonic() + 400
        while not Path(handshake).exists() or not Path(handshake).read_text():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the prefill side did not start")
            time.sleep(0.1)
        time.sleep(0.2)
        hs = json.loads(Path(handshake).read_text())
        got_ns = time.time_ns()
        n = len(hs["blocks"]) - 1                                   # the last block is recomputed
        reqs = Reqs(runner.num_blocks)
        dst = reqs.blocks(args.prompt_len)
        job = TierBlocks("d", dst[:n], [], hs["addr"], hs["blocks"][:n])

        def fetch() -> None:
            tiers.start_loads([job])
            done = []
            while not done:
                done = tiers.take_loads(1.0)
            assert done[0].num_loaded == n, done
        t0 = time.perf_counter()
        fetch()                                                     # the first: maps the peer too
        first_fetch_s = time.perf_counter() - t0
        nbytes = n * tiers.block_bytes
        secs = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fetch()
            secs.append(time.perf_counter() - t0)
        peer = tiers.peers.get(hs["addr"])
        same = all(torch.equal(p[:, hs["blocks"][:n]], c[:, dst[:n]]) for p, c in zip(peer.layers, runner.kv_caches))
        # The floor: a device-to-device copy of the same bytes in one process.
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        d2d = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            b.copy_(a)
            torch.cuda.synchronize()
            d2d.append(time.perf_counter() - t0)
        # The decode engine's first step after a hand-off: fetch + compute the last block + sample.
        step_ms = []
        tokens = []
        for i in range(args.reps):
            t0 = time.perf_counter()
            fetch()
            plan = reqs.plan()
            plan.new_requests.add(request_id=f"d{i}", token_ids=hs["tokens"], block_ids=dst,
                                  num_computed_tokens=n * BS, num_scheduled_tokens=args.prompt_len - n * BS,
                                  sampling=GREEDY)
            res = run(runner, plan)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            tokens.append(res.outputs[0].token_ids[0])
            fin = reqs.plan()
            fin.finished_ids.append(f"d{i}")
            run(runner, fin)
        best = nbytes / min(secs) / 1e9
        floor = nbytes / min(d2d) / 1e9
        out = {"device": torch.cuda.get_device_name(), "prompt_len": args.prompt_len, "blocks": n,
               "bytes": nbytes, "handoff_gbps_best": best, "handoff_gbps_median": nbytes / statistics.median(secs) / 1e9,
               "d2d_copy_gbps_best": floor, "ratio_vs_d2d": best / floor,
               "first_fetch_ms_with_mapping": first_fetch_s * 1e3,
               "handoff_to_first_step_ms_median": statistics.median(step_ms), "handoff_to_first_step_ms": step_ms,
               "bytes_identical": same, "first_token_prefill": hs["first_token"],
               "decode_tokens_after_handoff": tokens,
               "first_token_to_decode_side_ready_ms": (got_ns - hs["first_ns"]) / 1e6}
        print(json.dumps(out, indent=1), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    finally:
        Path(handshake + ".done").write_text("1")
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--handshake", default="")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    return prefill_side(args) if args.role == "prefill" else decode_side(args)


if __name__ == "__main__":
    sys.exit(main())
