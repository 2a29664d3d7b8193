"""Serving throughput with and without a torch.profiler capture running, side by side in one run.

Starts one mesh (the bundled SmolLM2 on this CPU, or --model-dir, --device cuda), keeps
--concurrency completions of --tokens tokens each in flight, and alternates timed phases:
baseline, profiled (a capture started with POST /profile/start just before the phase and
stopped with POST /profile/stop right after it), baseline, profiled, ... Interleaving the
phases cancels slow drift of the machine. The capture's Kineto warm-up (first capture only)
happens in an untimed priming capture before the first phase.

  .venv/bin/python bench/profiler_overhead.py [--phase-s 10] [--rounds 2] [--concurrency 8]

Prints the table and the ratio (profiled / baseline output tokens/s) and writes
bench/results/profiler_overhead.json."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ADMIN_KEY = "bench-admin-key-0001"
PROMPTS = ["The history of the printing press", "Write a poem about the sea", "Explain photosynthesis simply",
           "List five uses of copper", "What is a hash table?", "Describe a rainy day in Paris"]


async def run_phase(client, model: str, seconds: float, concurrency: int, tokens: int) -> dict:
    """Output tokens/s inside a fixed window: streamed chunks are timestamped and each carries
    usage.completion_tokens / chunks tokens, so requests that straddle the window's end count
    for the part they streamed inside it."""
    t_start = time.monotonic()
    deadline = t_start + seconds
    done = {"requests": 0, "tokens": 0.0, "errors": 0}

    async def one(prompt: str) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        stamps, used = [], 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                done["errors"] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    stamps.append(time.monotonic())
        if stamps and used:
            done["tokens"] += used / len(stamps) * sum(t <= deadline for t in stamps)
            done["requests"] += stamps[-1] <= deadline

    async def loop(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            await one(PROMPTS[(i + n) % len(PROMPTS)])
            n += 1

    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return {**done, "window_s": seconds, "wall_s": time.monotonic() - t_start,
            "tokens_per_s": done["tokens"] / seconds}


async def wait_final(client, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = (await client.get("/profile/status")).json()
        if s["state"] in ("CAPTURE_STATE_DONE", "CAPTURE_STATE_FAILED"):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"capture not finished: {s}")
        await asyncio.sleep(0.2)


async def profiled_phase(client, args, model: str) -> dict:
    r = await client.post("/profile/start", json={"max_seconds": args.phase_s + 30})
    r.raise_for_status()
    phase = await run_phase(client, model, args.phase_s, args.concurrency, args.tokens)
    t0 = time.monotonic()
    stop = await client.post("/profile/stop")
    stop.raise_for_status()
    phase["stop_s"] = time.monotonic() - t0
    final = await wait_final(client)
    worker = final["targets"][0]["worker"]
    phase.update(capture_state=final["state"], steps_captured=worker["steps_captured"],
                 trace_mb=int(worker["trace_bytes"]) / 1e6, trace_path=worker["trace_path"])
    return phase


async def bench(args, port: int) -> dict:
    import httpx
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                 limits=httpx.Limits(max_connections=args.concurrency + 4)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await run_phase(client, model, 3.0, args.concurrency, args.tokens)   # warm the mesh
        prime = await client.post("/profile/start", json={"max_seconds": 0.5})
        prime.raise_for_status()
        await wait_final(client)
        phases = []
        for _ in range(args.rounds):
            phases.append({"kind": "baseline", **await run_phase(client, model, args.phase_s, args.concurrency,
                                                                 args.tokens)})
            phases.append({"kind": "profiled", **await profiled_phase(client, args, model)})
    base = [p["tokens_per_s"] for p in phases if p["kind"] == "baseline"]
    prof = [p["tokens_per_s"] for p in phases if p["kind"] == "profiled"]
    return {"phases": phases, "baseline_tokens_per_s": statistics.mean(base),
            "profiled_tokens_per_s": statistics.mean(prof),
            "ratio_profiled_over_baseline": statistics.mean(prof) / statistics.mean(base)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--phase-s", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "profiler_overhead.json"))
    p.add_argument("--keep-traces", action="store_true", help="keep the (large) trace files")
    args = p.parse_args()

    import tempfile

    from services.cli.launcher import Mesh, MeshConfig, free_port
    model_dir = args.model_dir
    if model_dir is None:
        from services.models import prepare_model
        model_dir = str(prepare_model("smollm2"))
    profile_dir = tempfile.mkdtemp(prefix="meshllm-bench-profiles-")
    cfg = MeshConfig(model_dir=model_dir, port=free_port(), grpc_port=free_port(), device=args.device,
                     max_model_len=1024, max_num_seqs=max(32, args.concurrency), profile_dir=profile_dir,
                     gateway_args=["--admin-api-key", ADMIN_KEY])
    mesh = Mesh(cfg)
    mesh.start()
    try:
        result = asyncio.run(bench(args, cfg.port))
    finally:
        mesh.stop()
        if not args.keep_traces:
            import shutil
            shutil.rmtree(profile_dir, ignore_errors=True)
    result.update(config={"model_dir": model_dir, "device": args.device, "phase_s": args.phase_s,
                          "rounds": args.rounds, "concurrency": args.concurrency, "tokens": args.tokens},
                  machine={"cpus": os.cpu_count(), "python": platform.python_version()},
                  profile_dir=profile_dir if args.keep_traces else "(removed)")
    print(f"{'phase':<10} {'tok/s':>8} {'requests':>9} {'errors':>7} {'stop_s':>7} {'steps':>6} {'trace MB':>9}")
    for ph in result["phases"]:
        print(f"{ph['kind']:<10} {ph['tokens_per_s']:8.1f} {ph['requests']:9d} {ph['errors']:7d} "
              f"{ph.get('stop_s', float('nan')):7.3f} {ph.get('steps_captured', 0):6d} "
              f"{ph.get('trace_mb', 0.0):9.1f}")
    print(f"baseline {result['baseline_tokens_per_s']:.1f} tok/s, profiled {result['profiled_tokens_per_s']:.1f} "
          f"tok/s: ratio {result['ratio_profiled_over_baseline']:.3f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
