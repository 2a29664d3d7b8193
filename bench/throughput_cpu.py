"""Decode throughput of the whole mesh on this CPU, side by side with transformers on the same
weights and with the memory-bandwidth floor.

  .venv/bin/python bench/throughput_cpu.py [--model-dir DIR] [--tokens 128] [--concurrency 16]

Prints a table and writes bench/results/throughput_cpu.json."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The history of the printing press", "Write a poem about the sea", "Explain photosynthesis simply",
           "List five uses of copper", "What is a hash table?", "Describe a rainy day in Paris",
           "How do vaccines work?", "Tell me about the Moon landing"]


def stream_one(client, model, prompt, max_tokens):
    """(ttft_s, decode_tokens_per_s, n_tokens) for one streamed completion of exactly max_tokens."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            first = first or now
            last = now
    decode = (n - 1) / (last - first) if last and first and last > first else float("nan")
    return first - t0, decode, n


def bench_mesh(model_dir, tokens, concurrency):
    from openai import OpenAI

    from services.cli.launcher import Mesh, MeshConfig, free_port
    cfg = MeshConfig(model_dir=model_dir, port=free_port(), grpc_port=free_port(), max_model_len=2048,
                     max_num_seqs=max(32, concurrency))
    mesh = Mesh(cfg)
    mesh.start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key="x", timeout=600)
        model = cfg.served_model_name
        stream_one(client, model, "warm up", 8)
        singles = [stream_one(client, model, PROMPTS[i], tokens) for i in range(3)]
        results = [None] * concurrency

        def worker(i):
            results[i] = stream_one(client, model, PROMPTS[i % len(PROMPTS)] + f" (#{i})", tokens)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        total = sum(r[2] for r in results)
        return {
            "single_ttft_s": statistics.median(s[0] for s in singles),
            "single_decode_tok_s": statistics.median(s[1] for s in singles),
            "concurrent": concurrency,
            "concurrent_total_tokens": total,
            "concurrent_wall_s": wall,
            "concurrent_tok_s": total / wall,
            "concurrent_ttft_p50_s": statistics.median(r[0] for r in results),
        }
    finally:
        mesh.stop()


def bench_transformers(model_dir, tokens, concurrency):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for bs in (1, concurrency):
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok([PROMPTS[i % len(PROMPTS)] for i in range(bs)], return_tensors="pt", padding=True)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=4, do_sample=False)
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            dt = time.perf_counter() - t0
        out[f"batch{bs}_tok_s"] = bs * tokens / dt
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def memory_bandwidth_gb_s():
    import torch
    src = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9  # read + write


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    if a.model_dir is None:
        from services.models import prepare_model
        a.model_dir = str(prepare_model("smollm2"))
    mesh = bench_mesh(a.model_dir, a.tokens, a.concurrency)
    peer = bench_transformers(a.model_dir, a.tokens, a.concurrency)
    bw = memory_bandwidth_gb_s()
    floor_tok_s = bw * 1e9 / peer["weight_bytes"]  # batch 1 must read every weight once per token
    res = {
        "schema": 1, "bench": "throughput_cpu", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tokens_per_request": a.tokens, "mesh": mesh, "transformers": peer,
        "memory_bandwidth_gb_s": bw, "batch1_bandwidth_floor_tok_s": floor_tok_s,
        "ratios": {
            "single_vs_transformers": mesh["single_decode_tok_s"] / peer["batch1_tok_s"],
            "single_vs_bandwidth_floor": mesh["single_decode_tok_s"] / floor_tok_s,
            "concurrent_vs_transformers_batched": mesh["concurrent_tok_s"] / peer[f"batch{a.concurrency}_tok_s"],
            "concurrent_vs_single": mesh["concurrent_tok_s"] / mesh["single_decode_tok_s"],
        },
    }
    out = ROOT / "bench" / "results" / "throughput_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"{'':34}{'tokens/s':>10}")
    print(f"{'mesh, 1 stream (decode)':34}{mesh['single_decode_tok_s']:10.1f}   TTFT {mesh['single_ttft_s']*1e3:.0f} ms")
    print(f"{'mesh, %d concurrent (total)' % a.concurrency:34}{mesh['concurrent_tok_s']:10.1f}")
    print(f"{'transformers, batch 1':34}{peer['batch1_tok_s']:10.1f}")
    print(f"{'transformers, batch %d' % a.concurrency:34}{peer[f'batch{a.concurrency}_tok_s']:10.1f}")
    print(f"{'bandwidth floor, batch 1':34}{floor_tok_s:10.1f}   ({bw:.1f} GB/s)")
    for k, v in res["ratios"].items():
        print(f"  {k}: {v:.2f}")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
