"""CPU benchmark of the KV tiers through the whole mesh (docs/kv_tiers.md): the time to first token
of a ~4k-token prompt computed cold, loaded from the kvstore by the other replica, and served
from the local prefix cache, in one run (`meshllm serve --data-parallel-size 2`, SmolLM2), with
a memcpy of the loaded bytes measured in the same run as the floor of a load.

  .venv/bin/python bench/kv_tiers_ttft.py [--prompts 3] [--words 3300] [--out bench/results/kv_tiers_ttft.json]

Each prompt: drain engine-1 and send it (engine-0 computes it and saves its blocks), then drain
engine-0 and send it again (engine-1 loads them from the kvstore), then once more (engine-1's own
prefix cache). Streaming requests, max_tokens 1: TTFT is the time to the first content chunk."""
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

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import meshrun  # noqa: E402

ADMIN = "bench-admin-key-0001"
HDR = {"Authorization": f"Bearer {ADMIN}"}
VOCAB = ["river", "stone", "lantern", "harbor", "meadow", "engine", "copper", "willow", "signal", "orbit",
         "canvas", "thunder", "pepper", "marble", "falcon", "silver", "garden", "puzzle", "ribbon", "glacier"]


def passage(seed: int, words: int) -> str:
    x, out = seed * 7919 + 17, []
    for _ in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(VOCAB[x % len(VOCAB)])
    return f"Document {seed}: " + " ".join(out) + "\nSummary:"


def start(model_dir: str) -> tuple[subprocess.Popen, str, str]:
    return meshrun.start(model_dir, "--data-parallel-size", "2", "--max-model-len", "8192",
                         "--max-num-batched-tokens", "2048", "--kv-tier-capacity-gb", "2", "--admin-api-key", ADMIN)


def only(url: str, replica: str) -> None:
    other = "engine-1" if replica == "engine-0" else "engine-0"
    for body in ({"replica": replica, "undrain": True}, {"replica": other}):
        r = httpx.post(f"{url}/drain", json=body, headers=HDR, timeout=30)
        r.raise_for_status()
    time.sleep(0.6)


def ttft(url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage = None, {}
    with httpx.Client(timeout=600) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices"):
                first = time.perf_counter() - t0
            usage = ev.get("usage") or usage
    return {"ttft_ms": first * 1e3, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def memcpy_gbps(nbytes: int) -> float:
    import numpy as np
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/meshllm/models/smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--words", type=int, default=3300)
    ap.add_argument("--out", default=str(ROOT / "bench/results/kv_tiers_ttft.json"))
    args = ap.parse_args()
    proc, url, log = start(args.model)
    model = "smollm2-135m-instruct"
    rows = []
    try:
        ttft(url, model, "warm up")
        for i in range(args.prompts):
            p = passage(100 + i, args.words)
            only(url, "engine-0")
            cold = ttft(url, model, p)
            only(url, "engine-1")
            tier = ttft(url, model, p)
            local = ttft(url, model, p)
            rows.append({"cold": cold, "kvstore_other_replica": tier, "local_prefix_hit": local})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        meshrun.stop(proc)
    med = {k: statistics.median(r[k]["ttft_ms"] for r in rows) for k in rows[0]}
    # SmolLM2 on the CPU: float32 KV, 30 layers x (K, V) x 3 heads x 64 = 46 KiB per token.
    loaded_bytes = statistics.median(r["kvstore_other_replica"]["cached_tokens"] for r in rows) * 30 * 2 * 3 * 64 * 4
    floor_gbps = memcpy_gbps(int(loaded_bytes))
    out = {"host": platform.node(), "cpus": os.cpu_count(), "prompts": rows, "median_ttft_ms": med,
           "ratio_vs_cold": {k: v / med["cold"] for k, v in med.items()},
           "loaded_bytes": loaded_bytes, "memcpy_gbps_same_run": floor_gbps,
           "load_floor_ms": loaded_bytes / floor_gbps / 1e9 * 1e3, "target_tier_vs_cold": 0.15}
    print(json.dumps({k: v for k, v in out.items() if k != "prompts"}, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
