"""Async scheduling and prefix caching on the real model, each measured side by side in one run.

  .venv/bin/python bench/scheduler_features.py [--model-dir DIR]

1. The same workload (16 concurrent greedy streams) on a mesh with async scheduling on and
   on one with it off: output tokens/s and the ratio.
2. A ~1k-token prompt sent twice: time to first token of the repeat against the first, with
   prefix caching on and off (target: the repeat's TTFT <= 20% of the first with caching on).
Writes bench/results/scheduler_features.json."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start(model_dir: str, **kw):
    from services.cli.launcher import Mesh, MeshConfig, free_port
    cfg = MeshConfig(model_dir=model_dir, port=free_port(), grpc_port=free_port(), max_model_len=2048, **kw)
    mesh = Mesh(cfg)
    mesh.start()
    return mesh


def client_for(mesh):
    from openai import OpenAI
    return OpenAI(base_url=f"http://127.0.0.1:{mesh.cfg.port}/v1", api_key="x", timeout=600, max_retries=0)


def concurrent_throughput(mesh, n=16, tokens=48) -> float:
    client = client_for(mesh)
    model = mesh.cfg.served_model_name
    client.completions.create(model=model, prompt="warm up", max_tokens=4)
    counts = [0] * n

    def one(i):
        r = client.completions.create(model=model, prompt=f"Story number {i}: once upon a time", max_tokens=tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
        counts[i] = r.usage.completion_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def ttft(mesh, prompt: str) -> float:
    client = client_for(mesh)
    t0 = time.perf_counter()
    for chunk in client.completions.create(model=mesh.cfg.served_model_name, prompt=prompt, max_tokens=2,
                                           temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            return time.perf_counter() - t0
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    a = ap.parse_args()
    if a.model_dir is None:
        from services.models import prepare_model
        a.model_dir = str(prepare_model("smollm2"))
    long_prompt = " ".join(f"Fact {i}: the sky over city {i} was clear that morning." for i in range(70))
    res = {"schema": 1, "bench": "scheduler_features", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for name, kw in [("async_on", {"async_scheduling": True}), ("async_off", {"async_scheduling": False})]:
        mesh = start(a.model_dir, **kw)
        try:
            res[f"{name}_tok_s"] = concurrent_throughput(mesh)
        finally:
            mesh.stop()
    for name, kw in [("prefix_on", {"enable_prefix_caching": True}), ("prefix_off", {"enable_prefix_caching": False})]:
        mesh = start(a.model_dir, **kw)
        try:
            ttft(mesh, "warm up")
            first, repeat = ttft(mesh, long_prompt), ttft(mesh, long_prompt)
            res[name] = {"first_ttft_s": first, "repeat_ttft_s": repeat, "repeat_over_first": repeat / first}
        finally:
            mesh.stop()
    from tokenizers import Tokenizer
    res["long_prompt_tokens"] = len(Tokenizer.from_file(f"{a.model_dir}/tokenizer.json").encode(long_prompt).ids)
    res["ratios"] = {"async_on_over_off": res["async_on_tok_s"] / res["async_off_tok_s"],
                     "repeat_ttft_over_first_prefix_on": res["prefix_on"]["repeat_over_first"],
                     "repeat_ttft_over_first_prefix_off": res["prefix_off"]["repeat_over_first"]}
    out = ROOT / "bench" / "results" / "scheduler_features.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"16 concurrent streams: async on {res['async_on_tok_s']:.1f} tok/s, off {res['async_off_tok_s']:.1f} tok/s"
          f" (ratio {res['ratios']['async_on_over_off']:.2f})")
    for k in ("prefix_on", "prefix_off"):
        r = res[k]
        print(f"{res['long_prompt_tokens']}-token prompt, {k}: first TTFT {r['first_ttft_s']*1e3:.0f} ms, "
              f"repeat {r['repeat_ttft_s']*1e3:.0f} ms (repeat/first {r['repeat_over_first']:.2f})")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
