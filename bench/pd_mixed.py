"""CPU benchmark of prefill/decode disaggregation (docs/pd.md) on a mixed workload: short decode
streams driven by `meshllm bench serve` while long prompts arrive among them, on two engines
either colocated (`--data-parallel-size 2`) or disaggregated (`--prefill-replicas 1
--decode-replicas 1`), plus the short streams alone on the colocated mesh (the interference-free
floor), in one run. Reports TTFT and ITL percentiles of the short streams, the long prompts'
TTFT, and the ratios PD / colocated and each / floor.

  .venv/bin/python bench/pd_mixed.py [--out bench/results/pd_mixed.json]

Two GPUs (issue 20; the prefill engine on cuda:0, the decode engine on cuda:1, KV over NIXL;
the colocated replicas on one GPU each), with a random-weight 8B directory from
bench/make_random_model.py and ~8k-token long prompts:

  python3 bench/pd_mixed.py --device cuda --model DIR --served-model-name NAME --long-words 6000 \
      --short-in 256 --short-out 256 --num-prompts 256 --concurrency 64 --long-every-s 1 \
      --kv-direct-transport nixl --serve-args="--max-model-len 16384" --out $OUT/gpu_pd_two.json

Every run also reports its goodput: requests whose own p99 inter-token latency is within
--goodput-itl-ms (50) and TTFT within --goodput-ttft-ms (none by default); on CUDA with two GPUs
a device-to-device copy between them is timed first, and the PD run's hand-off bandwidth (the
decode worker's tier="direct" loads) is reported against it.

What two CPU cores can show: both engines' workers share the same two cores, so a long
prefill on the prefill engine still takes CPU from the decode engine's steps. The isolation PD
buys on separate GPUs (a decode step never waits behind a prefill chunk) shows here only as far
as the scheduler's batching is concerned, not as separate hardware; the hand-off's own cost
(saving, fetching) is what this run can measure honestly."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import meshrun  # noqa: E402
from bench.kv_tiers_ttft import passage, ttft  # noqa: E402

MODEL = "smollm2-135m-instruct"   # the served name (--served-model-name)


class LongPrompts(threading.Thread):
    """Long prompts, one every `every_s`, each timed to its first token."""

    def __init__(self, url: str, words: int, every_s: float, model: str = MODEL) -> None:
        super().__init__(daemon=True)
        self.url, self.words, self.every_s, self.model = url, words, every_s, model
        self.stop = threading.Event()
        self.ttft_ms: list[float] = []
        self.errors = 0

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.ttft_ms.append(ttft(self.url, self.model, passage(9000 + i, self.words))["ttft_ms"])
            except (httpx.HTTPError, TypeError):
                self.errors += 1
            i += 1
            self.stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))


def d2d_copy_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float | None:
    """GB/s of a cuda:0 -> cuda:1 copy (best of reps), or None without two GPUs. Its own
    process: the meshes need the GPUs' memory afterwards."""
    code = ("import torch,time\n"
            "if torch.cuda.device_count() < 2: print('none'); raise SystemExit\n"
            f"a=torch.empty({nbytes},dtype=torch.uint8,device='cuda:0'); b=torch.empty_like(a,device='cuda:1')\n"
            "b.copy_(a); torch.cuda.synchronize('cuda:0'); torch.cuda.synchronize('cuda:1'); best=1e9\n"
            f"for _ in range({reps}):\n"
            "    t=time.perf_counter(); b.copy_(a); torch.cuda.synchronize('cuda:1'); best=min(best,time.perf_counter()-t)\n"
            f"print({nbytes}/best/1e9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout.strip()
    return None if not out or out == "none" else float(out.splitlines()[-1])


def handoff_gbps(log_path: str) -> dict | None:
    """The decode engine's worker (engine 1): bytes and seconds of its tier="direct" loads."""
    urls = re.findall(r" worker-1-metrics=(127\.0\.0\.1:\d+)", open(log_path).read())
    if not urls:
        return None
    text = httpx.get(f"http://{urls[0]}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for labels, v in re.findall(rf"^meshllm:{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
                   if 'tier="direct"' in labels and 'direction="load"' in labels)
    nbytes, secs = total("kv_tier_bytes_total"), total("kv_tier_transfer_seconds_sum")
    return {"bytes": nbytes, "seconds": secs, "gbps": nbytes / secs / 1e9 if secs else None}


def one(model_dir: str, label: str, extra: list[str], args, with_long: bool) -> dict:
    proc, url, log = meshrun.start(model_dir, "--max-model-len", "4096", "--device", args.device,
                                   *shlex.split(args.serve_args), *extra, ready_timeout_s=args.ready_timeout_s)
    model = args.served_model_name
    try:
        ttft(url, model, "warm up")
        long = LongPrompts(url, args.long_words, args.long_every_s, model) if with_long else None
        if long is not None:
            long.start()
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        slos = [f"itl:{args.goodput_itl_ms}"] + ([f"ttft:{args.goodput_ttft_ms}"] if args.goodput_ttft_ms else [])
        cmd = [sys.executable, "-m", "services.benchmark", "serve", "--base-url", url, "--model", model,
               "--dataset-name", "random", "--random-input-len", str(args.short_in), "--random-output-len",
               str(args.short_out), "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
               "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,itl,tpot,e2el",
               "--metric-percentiles", "50,90,99", "--goodput", *slos, "--result-file", out, "--no-plot",
               "--disable-tqdm"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        if long is not None:
            long.stop.set()
            long.join(120)
        res = json.loads(Path(out).read_text())["runs"][0]
        row = {"label": label, "flags": extra, "short": {k: res[k] for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")},
               "output_throughput": res.get("output_throughput"), "completed": res.get("completed"),
               "failed": res.get("failed"), "goodput_req_s": res.get("goodput"), "goodput_slos": slos}
        if long is not None:
            row["long_prompts"] = {"n": len(long.ttft_ms), "errors": long.errors,
                                   "ttft_ms_median": statistics.median(long.ttft_ms) if long.ttft_ms else None,
                                   "ttft_ms": long.ttft_ms}
        if "--prefill-replicas" in extra:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            row["handoffs"] = [line for line in text.splitlines() if line.startswith("meshllm:gateway_pd_handoffs_total")]
            row["handoff_transfer"] = handoff_gbps(log)
        return row
    finally:
        meshrun.stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/meshllm/models/smollm2-135m-instruct"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--short-in", type=int, default=64)
    ap.add_argument("--short-out", type=int, default=48)
    ap.add_argument("--long-words", type=int, default=1500)
    ap.add_argument("--long-every-s", type=float, default=4.0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    ap.add_argument("--serve-args", default="", help="more `meshllm serve` flags for every mesh (note the =)")
    ap.add_argument("--kv-direct-transport", choices=["mmap", "nixl", "auto"], default=None,
                    help="the PD mesh's direct hand-off (default: serve's)")
    ap.add_argument("--goodput-itl-ms", type=float, default=50.0, help="goodput SLO: each request's p99 ITL")
    ap.add_argument("--goodput-ttft-ms", type=float, default=0.0, help="goodput SLO on TTFT too (0: none)")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/pd_mixed.json"))
    args = ap.parse_args()
    args.served_model_name = args.served_model_name or Path(args.model).name
    d2d = d2d_copy_gbps() if args.device == "cuda" else None
    pd_flags = ["--prefill-replicas", "1", "--decode-replicas", "1",
                *(["--kv-direct-transport", args.kv_direct_transport] if args.kv_direct_transport else [])]
    rows = [one(args.model, "colocated_alone", ["--data-parallel-size", "2"], args, with_long=False),
            one(args.model, "colocated", ["--data-parallel-size", "2"], args, with_long=True),
            one(args.model, "pd", pd_flags, args, with_long=True)]
    by = {r["label"]: r for r in rows}

    def p(row, metric, q):
        return row["short"][f"{metric}_ms"][f"p{q}"]
    ratios = {}
    for metric in ("ttft", "itl"):
        for q in (50, 90, 99):
            key = f"{metric}_p{q}"
            ratios[key] = {"pd_vs_colocated": p(by["pd"], metric, q) / p(by["colocated"], metric, q),
                           "pd_vs_floor": p(by["pd"], metric, q) / p(by["colocated_alone"], metric, q),
                           "colocated_vs_floor": p(by["colocated"], metric, q) / p(by["colocated_alone"], metric, q)}
    long_ratio = None
    if by["pd"]["long_prompts"]["ttft_ms_median"] and by["colocated"]["long_prompts"]["ttft_ms_median"]:
        long_ratio = by["pd"]["long_prompts"]["ttft_ms_median"] / by["colocated"]["long_prompts"]["ttft_ms_median"]
    goodput = {r["label"]: r["goodput_req_s"] for r in rows}
    transfer = by["pd"].get("handoff_transfer") or {}
    handoff = {"d2d_copy_gbps": d2d, "handoff_gbps": transfer.get("gbps"),
               "handoff_vs_d2d": transfer["gbps"] / d2d if d2d and transfer.get("gbps") else None}
    out = {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "runs": rows, "ratios": ratios,
           "long_prompt_ttft_pd_vs_colocated": long_ratio, "goodput_req_s": goodput, "handoff_bandwidth": handoff}
    print(json.dumps({"ratios": ratios, "long_prompt_ttft_pd_vs_colocated": long_ratio, "goodput_req_s": goodput,
                      "handoff_bandwidth": handoff, "handoffs": by["pd"].get("handoffs")}, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
