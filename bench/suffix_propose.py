"""Suffix decoding's host cost, side by side in one run: the time to propose for 32 requests (the
device-fed chains' per-step host work at concurrency 32) on a copying workload, and the shared
store of finished outputs read two ways: its index (spec/suffix_cache.py) against one scan of all
stored outputs joined (suffix.propose over the joined text: the design the index replaced).

  .venv/bin/python bench/suffix_propose.py [--rows 32] [--outputs 64] [--out bench/results/suffix_propose.json]

The workload: 3 passages of 200 tokens; the store holds --outputs copies of them with 5 tokens
changed each; every request's prompt embeds one passage and its output has copied part of it."""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from services.worker.spec.suffix import SENTINEL, SuffixProposer, propose  # noqa: E402
try:
    from services.worker.spec.suffix_cache import SuffixCache  # noqa: E402
except ImportError:   # a tree from before the index (e.g. 5077cbe, for the side-by-side in the docs)
    from services.worker.spec.suffix import SuffixCache  # noqa: E402

DEPTH, MIN_PROB, VOCAB = 24, 0.1, 2000


def workload(rows: int, outputs: int):
    rng = random.Random(0)
    passages = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(3)]
    stored = []
    for i in range(outputs):
        out = list(passages[i % 3])
        for _ in range(5):
            out[rng.randrange(len(out))] = rng.randrange(VOCAB)
        stored.append(out)
    cache = SuffixCache(DEPTH, outputs)
    for out in stored:
        cache.add_output(out)
    props = []
    for i in range(rows):
        p = passages[i % 3]
        prompt = [rng.randrange(VOCAB) for _ in range(30)] + p + [rng.randrange(VOCAB) for _ in range(10)]
        sp = SuffixProposer(DEPTH, MIN_PROB, cache, prompt)
        sp.extend(p[:50 + i])
        props.append(sp)
    return stored, cache, props


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--outputs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/suffix_propose.json")
    a = ap.parse_args()
    stored, cache, props = workload(a.rows, a.outputs)
    toks = [t for out in stored for t in (*out, SENTINEL)]
    arr = np.array(toks, dtype=np.int32)
    contexts = [sp.tokens[-(DEPTH - 1):] for sp in props]
    rows = []
    for k in (8, 17):
        whole = timed(lambda: [sp.propose(k) for sp in props], a.reps)
        indexed = timed(lambda: [cache.propose(c, k, MIN_PROB) for c in contexts], a.reps)
        joined = timed(lambda: [propose(arr, toks, c, k, DEPTH, MIN_PROB) for c in contexts], a.reps)
        same = all(cache.propose(c, k, MIN_PROB) == propose(arr, toks, c, k, DEPTH, MIN_PROB) for c in contexts)
        rows.append({"k": k, "proposer_ms": whole * 1e3, "store_indexed_ms": indexed * 1e3,
                     "store_joined_scan_ms": joined * 1e3, "joined_over_indexed": joined / indexed,
                     "same_proposals": same})
        print(f"k={k:2d} {a.rows} rows: proposer {whole * 1e3:.2f} ms; shared store indexed {indexed * 1e3:.2f} ms "
              f"vs joined scan {joined * 1e3:.2f} ms ({joined / indexed:.1f}x), same proposals: {same}")
    out = {"bench": "suffix_propose", "rows": a.rows, "outputs": a.outputs, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "runs": rows}
    path = ROOT / a.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
