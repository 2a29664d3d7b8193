"""CPU benchmark of prefill/decode disaggregation (docs/pd.md) on a mixed workload: short decode
streams driven by `meshllm bench serve` while long prompts arrive among them, on two engines
either colocated (`--data-parallel-size 2`) or disaggregated (`--prefill-replicas 1
--decode-replicas 1`), plus the short streams alone on the colocated mesh (the interference-free
floor), in one run. Reports TTFT and ITL percentiles of the short streams, the long prompts'
TTFT, and the ratios PD / colocated and each / floor.

  .venv/bin/python bench/pd_mixed.py [--out bench/results/pd_mixed.json]

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

MODEL = "smollm2-135m-instruct"


class LongPrompts(threading.Thread):
    """Long prompts, one every `every_s`, each timed to its first token."""

    def __init__(self, url: str, words: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.words, self.every_s = url, words, every_s
        self.stop = threading.Event()
        self.ttft_ms: list[float] = []
        self.errors = 0

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.ttft_ms.append(ttft(self.url, MODEL, passage(9000 + i, self.words))["ttft_ms"])
            except (httpx.HTTPError, TypeError):
                self.errors += 1
            i += 1
            self.stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))


def one(model_dir: str, label: str, extra: list[str], args, with_long: bool) -> dict:
    proc, url, log = meshrun.start(model_dir, "--max-model-len", "4096", *extra)
    try:
        ttft(url, MODEL, "warm up")
        long = LongPrompts(url, args.long_words, args.long_every_s) if with_long else None
        if long is not None:
            long.start()
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        cmd = [sys.executable, "-m", "services.benchmark", "serve", "--base-url", url, "--model", MODEL,
               "--dataset-name", "random", "--random-input-len", str(args.short_in), "--random-output-len",
               str(args.short_out), "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
               "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,itl,tpot,e2el",
               "--metric-percentiles", "50,90,99", "--result-file", out, "--no-plot", "--disable-tqdm"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        if long is not None:
            long.stop.set()
            long.join(120)
        res = json.loads(Path(out).read_text())["runs"][0]
        row = {"label": label, "flags": extra, "short": {k: res[k] for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")},
               "output_throughput": res.get("output_throughput"), "completed": res.get("completed"),
               "failed": res.get("failed")}
        if long is not None:
            row["long_prompts"] = {"n": len(long.ttft_ms), "errors": long.errors,
                                   "ttft_ms_median": statistics.median(long.ttft_ms) if long.ttft_ms else None,
                                   "ttft_ms": long.ttft_ms}
        if "--prefill-replicas" in extra:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            row["handoffs"] = [line for line in text.splitlines() if line.startswith("meshllm:gateway_pd_handoffs_total")]
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
    ap.add_argument("--out", default=str(ROOT / "bench/results/pd_mixed.json"))
    args = ap.parse_args()
    rows = [one(args.model, "colocated_alone", ["--data-parallel-size", "2"], args, with_long=False),
            one(args.model, "colocated", ["--data-parallel-size", "2"], args, with_long=True),
            one(args.model, "pd", ["--prefill-replicas", "1", "--decode-replicas", "1"], args, with_long=True)]
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
    out = {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "runs": rows, "ratios": ratios,
           "long_prompt_ttft_pd_vs_colocated": long_ratio}
    print(json.dumps({"ratios": ratios, "long_prompt_ttft_pd_vs_colocated": long_ratio,
                      "handoffs": by["pd"].get("handoffs")}, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
