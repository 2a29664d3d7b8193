"""Online vs offline, side by side in one run: output tok/s of the whole mesh (`meshllm serve DIR`
driven by `meshllm bench serve`, random 1,024-token prompts, 1,024 output tokens with ignore_eos)
over the same engine alone (the ModelRunner the worker service loads, driven in-process by
bench/gpu_decode.py's offline loop), for the same requests at each concurrency.

  # H200, Llama-3-8B shape (random bf16 weights, bench/make_random_model.py), bf16 then FP8:
  python3 bench/gpu_online.py --device cuda --preset llama3-8b --model-dir /tmp/rnd8b --out $OUT/gpu_online.json
  python3 bench/gpu_online.py --device cuda --preset llama3-8b --model-dir /tmp/rnd8b \\
      --quantization fp8 --kv-cache-dtype fp8 --out $OUT/gpu_online_fp8.json
  # CPU rehearsal (a minute; bench/results/online_cpu_rehearsal.json):
  .venv/bin/python bench/gpu_online.py --device cpu --preset tiny --input-len 32 --output-len 16 \\
      --requests 8 --concurrency 1 4 --out bench/results/online_cpu_rehearsal.json

For each concurrency c the workload is n_c = min(--requests, --rounds * c) requests (so c = 1 does
not take an hour at 1k/1k on an 8B model); the offline loop runs the same n_c requests with at most
c at once (max_seqs = c), the same token budget, KV cache size and dtype, quantization and block
size as the served engine. `offline_engine` is --requests requests at --max-num-seqs at once.
Ratios: online output tok/s / offline output tok/s at each c.

Each phase is its own process, bounded by a timeout: the model directory is written by
make_random_model.py (unless --model-dir already holds one), the offline runs by this script
with --offline-only (so its GPU memory is gone before the mesh loads the model), the mesh by
`python -m services.cli.main serve` (stopped in a `finally`: SIGTERM, then SIGKILL to its process
group and every process below it), each load by `python -m services.cli.main bench serve`.
A mesh that does not come up prints its log's tail. Logs go to --log-dir (default: a temp dir).
The JSON is rewritten after every phase. On the H200 the serve path needs carried wheels (fastapi,
uvicorn, pyzmq, ...), the generated protobuf code and the tokenizer: bench/README.md gives the calls.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from make_random_model import add_shape_args  # noqa: E402

SERVED_NAME = "random-llama"
# What `meshllm serve` imports beyond torch / numpy / safetensors / tokenizers / grpcio / protobuf
# (checked before the mesh starts, so a machine without them fails in a second, not at a timeout).
# (Recorded from a CPU run's sys.modules; fastapi 0.165 imports opentelemetry's API itself.)
SERVE_MODULES = ("fastapi", "starlette", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
                 "opentelemetry", "uvicorn", "h11", "anyio", "zmq", "grpc", "grpc_health", "grpc_reflection",
                 "google.protobuf", "prometheus_client", "jinja2", "crc32c", "tokenizers")


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log at {path}: {exc})"


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the supervisor runs each service in a process group of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, level = [], [pid]
    while level:
        level = [kid for parent in level for kid in children.get(parent, [])]
        found += level
    return found


class Mesh:
    """`meshllm serve` as a child process in its own process group (so a Ctrl-C here reaches this
    script's `finally`, not the services half-way) that dies with this script (PDEATHSIG)."""

    def __init__(self, model_dir: str, flags: list[str], log_path: Path) -> None:
        from services.common.ports import free_port
        from services.common.procs import die_with_parent
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "services.cli.main", "serve", model_dir, "--port", str(self.port),
                    "--grpc-port", str(free_port()), "--served-model-name", SERVED_NAME, *flags]
        self.seen: set[int] = set()
        print("mesh:", shlex.join(self.cmd), flush=True)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, process_group=0, preexec_fn=die_with_parent)
        self.ready_s = None

    def wait_ready(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshllm serve exited with code {self.proc.returncode} before it was ready; "
                                   f"the end of {self.log_path}:\n{log_tail(self.log_path)}")
            self.seen.update(_descendants(self.proc.pid))
            if "meshllm is up" in log_tail(self.log_path, 400):
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                        if r.status == 200:
                            self.ready_s = time.monotonic() - t0
                            return
                except OSError:
                    pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"meshllm serve was not ready after {timeout_s:.0f} s; "
                                   f"the end of {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(1.0)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"meshllm serve exited with code {self.proc.returncode} during the run; "
                               f"the end of {self.log_path}:\n{log_tail(self.log_path)}")
        self.seen.update(_descendants(self.proc.pid))

    def stop(self, grace_s: float = 60.0) -> list[int]:
        """SIGTERM the launcher (it stops the supervisor, which stops every service), then SIGKILL
        its process group and whatever it ever ran that is still there. Returns those killed."""
        if self.proc.poll() is None:
            self.seen.update(_descendants(self.proc.pid))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        killed = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # process_group=0: its group id is its pid
        except ProcessLookupError:
            pass
        self.proc.wait()
        deadline = time.monotonic() + 10.0
        for pid in sorted(self.seen):
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid) and _is_service(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        self.log.close()
        return killed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _is_service(pid: int) -> bool:
    """Still one of the mesh's processes (`python -m services.X`), not a reused pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"services." in f.read()
    except OSError:
        return False


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, what: str, env: dict | None = None) -> None:
    """Run a phase to completion (output appended to log_path); a failure or a timeout raises with
    the log's tail."""
    print(f"{what}:", shlex.join(cmd), flush=True)
    with open(log_path, "ab") as log:
        try:
            p = subprocess.run(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} did not finish in {timeout_s:.0f} s; the end of {log_path}:\n"
                               f"{log_tail(log_path)}") from None
    if p.returncode != 0:
        raise RuntimeError(f"{what} exited with code {p.returncode}; the end of {log_path}:\n{log_tail(log_path)}")


def workload(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(concurrency, requests) of each measured point."""
    return [(c, max(1, min(a.requests, a.rounds * c))) for c in a.concurrency]


# ---- the offline phase (a child process: --offline-only) ------------------------------------

def offline_phase(a: argparse.Namespace) -> dict:
    """The worker service's runner (services/worker/load.py) for this model and these flags,
    driven by gpu_decode.offline: a warm-up, each (c, n_c) point, then --requests at --max-num-seqs."""
    import torch

    from gpu_decode import BS, offline
    from services.worker.config import WorkerConfig
    from services.common.gc_heap import freeze_startup_heap
    from services.worker.load import load_model_runner
    cfg = WorkerConfig(model=a.model_dir, zmq_addr="inproc://gpu-online", device=a.device, dtype=a.dtype,
                       max_model_len=a.max_model_len, kv_cache_memory_gb=a.kv_cache_memory_gb,
                       kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization, block_size=BS,
                       served_model_name=SERVED_NAME)
    t0 = time.perf_counter()
    runner = load_model_runner(cfg)
    runner.hello(BS)
    runner.constraints.warm().result(timeout=300)   # the structured-output tokenizer's build: not during a run
    vocab = runner.model.cfg.vocab_size
    out = {"device": torch.cuda.get_device_name() if runner.model.device.type == "cuda" else "cpu",
           "torch": torch.__version__, "load_s": time.perf_counter() - t0, "num_kv_blocks": runner.num_blocks,
           "model_dtype": str(runner.model.dtype).removeprefix("torch."),
           "kv_dtype": str(runner.kv_dtype).removeprefix("torch."), "runs": []}
    gen = torch.Generator().manual_seed(a.seed)
    warm = min(4, a.max_num_seqs)
    offline(runner, warm, warm, a.input_len, min(8, a.output_len), a.max_num_batched_tokens, gen, 120.0, vocab=vocab)
    freeze_startup_heap()   # as the worker does once loaded (services/worker/engine.py): like for like
    points = [(c, n, "point") for c, n in workload(a)]
    if (a.max_num_seqs, a.requests) not in [(c, n) for c, n, _ in points]:
        points.append((a.max_num_seqs, a.requests, "offline_engine"))
    for c, n, kind in points:
        r = offline(runner, n, c, a.input_len, a.output_len, a.max_num_batched_tokens, gen, a.offline_cap_s,
                    vocab=vocab)
        r["kind"] = kind
        out["runs"].append(r)
        print("offline", json.dumps(r), flush=True)
        Path(a.offline_only).write_text(json.dumps(out, indent=1))
    return out


# ---- the parent ----------------------------------------------------------------------------

def serve_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--device", a.device, "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
             "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--kv-cache-memory-gb",
             str(a.kv_cache_memory_gb), "--kv-cache-dtype", a.kv_cache_dtype, "--quantization", a.quantization]
    if a.max_model_len:
        flags += ["--max-model-len", str(a.max_model_len)]
    if a.api_server_count is not None:   # passed only when asked for (a newer launcher flag)
        flags += ["--api-server-count", a.api_server_count]
    return flags + shlex.split(a.serve_args)


def bench_cmd(a: argparse.Namespace, url: str, model_dir: str, c: int, n: int, out_len: int, result: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli.main", "bench", "serve", "--base-url", url, "--model", SERVED_NAME,
            "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(a.input_len),
            "--random-output-len", str(out_len), "--num-prompts", str(n), "--max-concurrency", str(c),
            "--ignore-eos", "--seed", str(a.seed), "--request-timeout", str(a.bench_timeout_s),
            "--disable-tqdm", "--no-plot", "--result-file", str(result)]


def summary(run: dict) -> dict:
    keep = ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput", "errors", "error_examples")
    s = {k: run.get(k) for k in keep}
    for m in ("ttft", "tpot", "itl", "e2el"):
        d = run.get(f"{m}_ms") or {}
        s[f"{m}_ms"] = {k: d.get(k) for k in ("mean", "p50", "p99")}
    return s


def missing_serve_modules() -> list[str]:
    import importlib.util
    missing = []
    for m in SERVE_MODULES:
        try:
            if importlib.util.find_spec(m) is None:
                missing.append(m)
        except ModuleNotFoundError:   # a dotted name whose parent is missing
            missing.append(m)
    return missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--model-dir", default=None,
                   help="serve this directory (made there by make_random_model.py if it holds no config.json); "
                        "default: a new temporary one, removed at the end")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=512, help="offline_engine's requests; caps each point's")
    p.add_argument("--rounds", type=int, default=2, help="each point runs min(--requests, rounds * c) requests")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--max-num-seqs", type=int, default=0, help="serve's (default: the largest --concurrency)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=0, help="serve's (default: the model's)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.0, help="default: 80 on cuda, 1 on cpu")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--api-server-count", default=None, help="passed to serve only when given")
    p.add_argument("--serve-args", default="", help="more `meshllm serve` flags, one shell-quoted string")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured load (largest c, 16 output tokens) sent before the first point")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-online", action="store_true")
    p.add_argument("--make-timeout-s", type=float, default=600.0)
    p.add_argument("--offline-timeout-s", type=float, default=900.0)
    p.add_argument("--offline-cap-s", type=float, default=300.0, help="each offline run stops planning after this")
    p.add_argument("--ready-timeout-s", type=float, default=420.0)
    p.add_argument("--bench-timeout-s", type=float, default=900.0, help="each `bench serve` run")
    p.add_argument("--make-device", default=None, help="where make_random_model draws weights (default: --device)")
    p.add_argument("--log-dir", default=None, help="the phases' logs (default: a temp dir, kept and printed)")
    p.add_argument("--out", default="bench/results/gpu_online.json")
    p.add_argument("--offline-only", default=None, help=argparse.SUPPRESS)   # the child: write its JSON here
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(raw_argv)
    a.max_num_seqs = a.max_num_seqs or max(a.concurrency)
    a.kv_cache_memory_gb = a.kv_cache_memory_gb or (80.0 if a.device == "cuda" else 1.0)
    if a.max_num_batched_tokens < a.input_len:
        p.error("--max-num-batched-tokens must be >= --input-len (the offline loop admits whole prompts)")
    if max(a.concurrency) > a.max_num_seqs:
        p.error("--max-num-seqs must be >= every --concurrency")
    if a.offline_only:
        offline_phase(a)
        return 0

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The phases' JSON files go to scratch (removed at the end); log_dir gets the four logs alone
    # (make_model, offline, mesh, bench), so --log-dir $OUT/logs stays within what a device run returns.
    scratch = Path(tempfile.mkdtemp(prefix="gpu-online-"))
    log_dir = Path(a.log_dir) if a.log_dir else scratch
    log_dir.mkdir(parents=True, exist_ok=True)
    tmp_model = None
    if a.model_dir is None:
        tmp_model = tempfile.mkdtemp(prefix="gpu-online-model-")
        a.model_dir = tmp_model
    model_dir = str(Path(a.model_dir).resolve())
    a.model_dir = model_dir
    res: dict = {"bench": "gpu_online", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:],
                 "device": a.device, "model_dir": model_dir, "input_len": a.input_len, "output_len": a.output_len,
                 "workload": [{"concurrency": c, "requests": n} for c, n in workload(a)],
                 "engine": {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
                            "kv_cache_memory_gb": a.kv_cache_memory_gb, "kv_cache_dtype": a.kv_cache_dtype,
                            "quantization": a.quantization, "block_size": 16, "dtype": a.dtype},
                 "log_dir": str(log_dir)}

    def save() -> None:
        out.write_text(json.dumps(res, indent=1) + "\n")

    mesh = None
    try:
        missing = [] if a.skip_online else missing_serve_modules()
        if missing:   # before minutes of model writing and offline runs
            raise RuntimeError(f"meshllm serve needs modules this python lacks: {', '.join(missing)} "
                               "(carry their wheels: bench/README.md, gpu_online.py)")
        if not (Path(model_dir) / "config.json").is_file():
            cmd = [sys.executable, str(ROOT / "bench" / "make_random_model.py"), model_dir, "--preset", a.preset,
                   "--seed", str(a.seed), "--device", a.make_device or a.device, "--max-shard-gb", str(a.max_shard_gb)]
            for flag in ("hidden", "layers", "heads", "kv_heads", "intermediate", "head_dim",
                         "max_position_embeddings", "rope_theta", "tokenizer_dir"):
                if getattr(a, flag) is not None:
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
            if a.tie_word_embeddings:
                cmd.append("--tie-word-embeddings")
            t0 = time.monotonic()
            run_logged(cmd, log_dir / "make_model.log", a.make_timeout_s, "make_random_model")
            res["make_model_s"] = time.monotonic() - t0
        res["model"] = json.loads((Path(model_dir) / "random_model.json").read_text()) \
            if (Path(model_dir) / "random_model.json").is_file() else json.loads((Path(model_dir) / "config.json").read_text())
        save()

        if not a.skip_offline:
            child_json = scratch / "offline.json"
            child = [sys.executable, str(Path(__file__).resolve()), *raw_argv, "--model-dir", model_dir,
                     "--offline-only", str(child_json)]
            t0 = time.monotonic()
            try:
                # as the worker's main() sets it before torch loads (idle OpenMP threads sleep)
                env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
                run_logged(child, log_dir / "offline.log", a.offline_timeout_s, "offline", env=env)
            finally:   # what the runs that finished measured, even when a later one failed
                if child_json.is_file():
                    res["offline"] = json.loads(child_json.read_text())
                    res["offline"]["phase_s"] = time.monotonic() - t0
                    save()

        if not a.skip_online:
            flags = serve_flags(a)
            t0 = time.monotonic()
            mesh = Mesh(model_dir, flags, log_dir / "mesh.log")
            mesh.wait_ready(a.ready_timeout_s)
            res["online"] = {"serve_flags": flags, "ready_s": mesh.ready_s, "runs": []}
            save()
            print(f"mesh ready in {mesh.ready_s:.1f} s at {mesh.url}", flush=True)
            if not a.no_warmup:
                c = max(a.concurrency)
                run_logged(bench_cmd(a, mesh.url, model_dir, c, c, min(16, a.output_len), scratch / "warmup.json"),
                           log_dir / "bench.log", a.bench_timeout_s, f"warm-up (c={c})")
            for c, n in workload(a):
                result = scratch / f"bench_c{c}.json"
                run_logged(bench_cmd(a, mesh.url, model_dir, c, n, a.output_len, result), log_dir / "bench.log",
                           a.bench_timeout_s, f"bench serve c={c} n={n}")
                mesh.check_alive()
                (run,) = json.loads(result.read_text())["runs"]
                row = {"concurrency": c, "requests": n, **summary(run)}
                res["online"]["runs"].append(row)
                print(f"online c={c}: {row['output_throughput']:.1f} output tok/s, "
                      f"TTFT mean {row['ttft_ms']['mean']:.0f} ms, TPOT mean {row['tpot_ms']['mean']:.2f} ms", flush=True)
                save()
    except (RuntimeError, OSError, ValueError) as exc:
        res["error"] = str(exc)
        print(f"gpu_online: {exc}", file=sys.stderr, flush=True)
    finally:
        if mesh is not None:
            killed = mesh.stop()
            res.setdefault("online", {})["stopped_by_sigkill"] = killed
            if killed:
                print(f"mesh: SIGKILLed processes left after SIGTERM: {killed}", flush=True)
        import shutil
        if tmp_model:
            shutil.rmtree(tmp_model, ignore_errors=True)
        if scratch != log_dir:
            shutil.rmtree(scratch, ignore_errors=True)
        res["ratios"] = ratios(res)
        save()
    print_table(res)
    print(f"wrote {out} (logs: {log_dir})")
    return 1 if "error" in res else 0


def ratios(res: dict) -> list[dict]:
    off = {(r["max_num_seqs"], r["requests"]): r for r in res.get("offline", {}).get("runs", [])}
    rows = []
    for on in res.get("online", {}).get("runs", []):
        o = off.get((on["concurrency"], on["requests"]))
        if o is None:
            continue
        rows.append({"concurrency": on["concurrency"], "requests": on["requests"],
                     "offline_output_tok_per_s": o["output_tok_per_s"], "online_output_tok_per_s": on["output_throughput"],
                     "online_over_offline": on["output_throughput"] / o["output_tok_per_s"]})
    return rows


def print_table(res: dict) -> None:
    print(f"\n{'c':>5} {'requests':>9} {'offline tok/s':>14} {'online tok/s':>13} {'online/offline':>15}")
    for r in res["ratios"]:
        print(f"{r['concurrency']:>5} {r['requests']:>9} {r['offline_output_tok_per_s']:>14.1f} "
              f"{r['online_output_tok_per_s']:>13.1f} {r['online_over_offline']:>15.3f}")
    eng = [r for r in res.get("offline", {}).get("runs", []) if r.get("kind") == "offline_engine"]
    for r in eng:
        print(f"offline engine: {r['requests']} requests at {r['max_num_seqs']} at once: "
              f"{r['output_tok_per_s']:.1f} output tok/s")


if __name__ == "__main__":
    raise SystemExit(main())
