"""Two revisions of the tree side by side in one run: the CPU throughput of the whole mesh (what
`make bench` measures) and the frontend ceiling (`meshllm bench serve` against
`--simulate-worker`), interleaved old, new, new, old, old, new, ... (the order flips every round, so
a drift of the machine's load over the run weighs on both alike).

  .venv/bin/python bench/compare_revisions.py [--old REV] [--new REV|worktree] [--rounds 4]
                                              [--parts cpu_mesh,frontend] [--out FILE]

Each revision runs from a git worktree of its own (protobuf code generated there), with this
venv; `--new worktree` (the default) is the checkout this script lives in. The load generator is
always the new tree's. Writes bench/results/compare_revisions.json with every run, the medians
and the new/old ratios."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PY = sys.executable


def checkout(rev: str) -> pathlib.Path:
    """A worktree of `rev` with its protobuf code generated; the current checkout for 'worktree'."""
    if rev == "worktree":
        return ROOT
    path = pathlib.Path(tempfile.mkdtemp(prefix=f"meshllm-{rev[:10]}-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev],
                   check=True, capture_output=True)
    subprocess.run([PY, "scripts/gen_protos.py"], cwd=path, check=True, capture_output=True)
    return path


def remove(path: pathlib.Path) -> None:
    if path != ROOT:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def run_in(tree: pathlib.Path, code: str, timeout_s: float = 900) -> dict:
    """Run `code` with `tree` first on the path (so the mesh it starts is that tree's); it prints
    one JSON line last."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([PY, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


CPU_MESH = """
import json, sys
sys.path.insert(0, {bench!r})
from throughput_cpu import bench_mesh
print(json.dumps(bench_mesh({model!r}, {tokens}, {concurrency})))
"""

FRONTEND = """
import json, os, subprocess, sys, time, urllib.request
from services.cli.launcher import free_port
port, gport = free_port(), free_port()
server = subprocess.Popen([sys.executable, "-m", "services.cli.main", "serve", {model!r}, "--port", str(port),
                           "--grpc-port", str(gport), "--simulate-worker", "--max-num-seqs", "256",
                           "--max-model-len", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    deadline = time.monotonic() + 180
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{{port}}/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("the simulated mesh did not become ready")
        time.sleep(0.5)
    out = {result!r}
    subprocess.run([sys.executable, "-m", "services.benchmark", "serve", "--base-url", f"http://127.0.0.1:{{port}}",
                    "--tokenizer", {model!r}, "--num-prompts", "{prompts}", "--max-concurrency", "256",
                    "--random-input-len", "32", "--random-output-len", "128", "--ignore-eos",
                    "--num-warmups", "64", "--result-file", out],
                   check=True, stdout=subprocess.DEVNULL, env={{**os.environ, "PYTHONPATH": {loadgen!r}}},
                   cwd={loadgen!r})
    run = json.load(open(out))["runs"][0]
    print(json.dumps({{k: run[k] for k in ("output_throughput", "request_throughput", "completed", "failed")}}
                     | {{"mean_ttft_ms": run["ttft_ms"]["mean"], "mean_tpot_ms": run["tpot_ms"]["mean"]}}))
finally:
    server.terminate()
    server.wait(60)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="ef38d9e")
    ap.add_argument("--new", default="worktree")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--parts", default="cpu_mesh,frontend", help="which measurements: cpu_mesh, frontend")
    ap.add_argument("--out", default="bench/results/compare_revisions.json")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    if a.model_dir is None:
        from services.models import prepare_model
        a.model_dir = str(prepare_model("smollm2"))
    trees = {"old": checkout(a.old), "new": checkout(a.new)}
    runs: dict[str, dict[str, list]] = {k: {"cpu_mesh": [], "frontend": []} for k in trees}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="meshllm-compare-"))
    try:
        for r in range(a.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                line = f"round {r} {name:3}:"
                if "cpu_mesh" in parts:
                    cpu = run_in(tree, CPU_MESH.format(bench=str(ROOT / "bench"), model=a.model_dir,
                                                       tokens=a.tokens, concurrency=a.concurrency))
                    runs[name]["cpu_mesh"].append(cpu)
                    line += (f" mesh 1 stream {cpu['single_decode_tok_s']:7.1f} tok/s, {a.concurrency} streams "
                             f"{cpu['concurrent_tok_s']:7.1f} tok/s |")
                if "frontend" in parts:
                    fe = run_in(tree, FRONTEND.format(model=a.model_dir, prompts=a.prompts, loadgen=str(ROOT),
                                                      result=str(tmp / f"{name}-{r}.json")))
                    runs[name]["frontend"].append(fe)
                    line += (f" frontend {fe['output_throughput']:9.1f} tok/s {fe['request_throughput']:6.1f} req/s "
                             f"(failed {fe['failed']})")
                print(line, flush=True)
    finally:
        for tree in trees.values():
            remove(tree)
        shutil.rmtree(tmp, ignore_errors=True)

    def med(name: str, part: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name][part])

    metrics = [(p, k) for p, k in (("cpu_mesh", "single_decode_tok_s"), ("cpu_mesh", "concurrent_tok_s"),
                                   ("frontend", "output_throughput"), ("frontend", "request_throughput"))
               if p in parts]
    medians = {n: {f"{p}.{k}": med(n, p, k) for p, k in metrics} for n in trees}
    ratios = {m: medians["new"][m] / medians["old"][m] for m in medians["new"]}
    res = {"schema": 1, "bench": "compare_revisions", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "old": a.old, "new": a.new if a.new != "worktree" else subprocess.run(
               ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
           "workload": {"cpu_mesh": f"{a.concurrency} streams x {a.tokens} tokens, SmolLM2-135M on the CPU",
                        "frontend": f"simulated worker, {a.prompts} prompts, 256 concurrent, 32 in / 128 out"},
           "runs": runs, "medians": medians, "ratios_new_over_old": ratios}
    out = ROOT / a.out
    out.write_text(json.dumps(res, indent=2))
    for m, v in ratios.items():
        print(f"  {m:36} old {medians['old'][m]:10.1f}  new {medians['new'][m]:10.1f}  new/old {v:.3f}")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
