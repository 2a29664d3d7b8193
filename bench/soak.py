"""A bounded soak: a 2-replica mesh under mixed load, with random client cancellations and
one injected failure a minute (kill -9 of a worker or a scheduler; the supervisor restarts it).

  .venv/bin/python bench/soak.py [--duration-s 180] [--concurrency 8] [--failure-every-s 60]
                                 [--real-worker] [--out bench/results/soak.json]

It starts `meshllm serve MODEL --data-parallel-size 2 --tokenizer-replicas 2` (simulated
workers by default: CPU-cheap, real tokens are not the point; --real-worker runs SmolLM2),
drives it with streaming and non-streaming completions and chat completions (some sharing a
long prefix, some cancelled by the client mid-stream, some given up by a short client
timeout), kills one engine process a minute, and reports:
  - outcomes and errors by kind: HTTP status, SSE error event, a stream that ended without a
    finish reason or an error (a silent truncation), a client timeout (a hang);
    errors within `--blame-window-s` after an injected failure are counted apart;
  - p50/p99 end-to-end latency and time to first token of the completed requests;
  - RSS of every service process, sampled through the run, and its growth (first sample
    after the warm-up -> last; a restarted process is measured from its restart);
  - what the mesh says: supervisor restarts, requests the gateway moved before their first
    token, tokens produced after aborts, and whether any process was left behind."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import signal
import statistics
import sys
import time
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402

from services.common import pb  # noqa: E402
from tests.integration.meshproc import alive, start_mesh  # noqa: E402

MODEL = "smollm2-135m-instruct"
PREFIX = "You are a meticulous assistant. Answer briefly and cite the rules you used. " * 8


# ---- load ----------------------------------------------------------------------------------

class Stats:
    def __init__(self) -> None:
        self.outcomes: Counter = Counter()
        self.errors: Counter = Counter()
        self.errors_blamed: Counter = Counter()   # within the blame window of an injection
        self.e2e: list[float] = []
        self.ttft: list[float] = []
        self.kills: list[float] = []              # monotonic times of injected failures
        self.blame_window_s = 10.0

    def error(self, kind: str, t_start: float) -> None:
        self.outcomes["error"] += 1
        # The request overlapped [kill, kill + window]: in flight at the kill, or sent while
        # the mesh was recovering from it.
        now = time.monotonic()
        blamed = any(t_start <= k + self.blame_window_s and now >= k for k in self.kills)
        (self.errors_blamed if blamed else self.errors)[kind] += 1


def _body(rng: random.Random, i: int) -> tuple[str, dict]:
    max_tokens = rng.randint(8, 96)
    shared = rng.random() < 0.3
    text = (PREFIX if shared else "") + f"Request {i}: tell me about {rng.randint(0, 10**6)}."
    if rng.random() < 0.3:
        return "/v1/chat/completions", {"model": MODEL, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": max_tokens}


def _classify(message: str) -> str:
    if "no engine replica" in message:
        return "no_replica_ready"
    if "engine" in message:
        return "engine_lost"
    return "tokenizer" if "tokenizer" in message else "other"


def _why(r: httpx.Response) -> str:
    try:
        return _classify(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "other"


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int, st: Stats,
               timeout_s: float) -> None:
    route, body = _body(rng, i)
    stream = rng.random() < 0.7
    cancel_after = rng.randint(1, 5) if stream and rng.random() < 0.15 else None
    give_up_s = 0.3 if not stream and rng.random() < 0.05 else None
    body["stream"] = stream
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(give_up_s or timeout_s):
            if not stream:
                r = await client.post(route, json=body)
                if r.status_code != 200:
                    return st.error(f"http_{r.status_code}_{_why(r)}", t0)
                if not r.json()["choices"][0].get("finish_reason"):
                    return st.error("no_finish_reason", t0)
                st.e2e.append(time.monotonic() - t0)
                st.outcomes["ok"] += 1
                return
            events, finished, first = 0, False, None
            async with client.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return st.error(f"http_{r.status_code}_{_why(r)}", t0)
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        return st.error(f"sse_error_{_classify(obj['error'].get('message', ''))}",
                                        t0)
                    if first is None and any(c.get("text") or c.get("delta", {}).get("content")
                                             for c in obj.get("choices", [])):
                        first = time.monotonic() - t0
                    finished |= any(c.get("finish_reason") for c in obj.get("choices", []))
                    events += 1
                    if cancel_after is not None and events >= cancel_after:
                        st.outcomes["cancelled_by_client"] += 1
                        return  # leaving the block closes the connection mid-stream
            if not finished:
                return st.error("truncated_stream", t0)
            st.e2e.append(time.monotonic() - t0)
            if first is not None:
                st.ttft.append(first)
            st.outcomes["ok"] += 1
    except TimeoutError:
        if give_up_s is not None:
            st.outcomes["cancelled_by_client"] += 1
        else:
            st.error("timeout_hang", t0)
    except httpx.HTTPError as err:
        st.error(f"client_{type(err).__name__}", t0)


async def _load(url: str, concurrency: int, deadline: float, st: Stats, seed: int,
                timeout_s: float) -> int:
    n = 0
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        async def worker(w: int) -> None:
            nonlocal n
            rng = random.Random(seed * 1000 + w)
            while time.monotonic() < deadline:
                n += 1
                await _one(client, rng, n, st, timeout_s)
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return n


# ---- the mesh: failures, memory, counters --------------------------------------------------

def _replicas(sup_addr: str) -> list:
    with grpc.insecure_channel(sup_addr) as ch:
        return list(pb.supervisor_grpc.SupervisorStub(ch).ListReplicas(
            pb.supervisor.ListReplicasRequest(), timeout=10).replicas)


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        mod = next((a.decode() for a in args if a.startswith(b"services.")), "?")
        return mod.removeprefix("services.")
    except OSError:
        return "?"


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _sample_memory(sup_addr: str, supervisor_pid: int, series: dict) -> None:
    now = time.monotonic()
    procs = [("supervisor", supervisor_pid)]
    for r in _replicas(sup_addr):
        procs += [(f"{r.id}/{_proc_name(pid)}", pid) for pid in r.pids]
    for key, pid in procs:
        rss = _rss_mb(pid)
        if rss is not None:
            series.setdefault(key, []).append((now, pid, rss))


async def _inject(sup_addr: str, every_s: float, deadline: float, st: Stats,
                  rng: random.Random, log: list) -> None:
    await asyncio.sleep(every_s / 2)
    while time.monotonic() < deadline - 10:
        engines = [r for r in _replicas(sup_addr)
                   if r.kind == pb.supervisor.REPLICA_KIND_ENGINE and r.pids]
        if engines:
            # Alternate the kind of process killed (worker first), on a random replica.
            victim = rng.choice(engines)
            want = "worker" if len(log) % 2 == 0 else "scheduler"
            pids = [p for p in victim.pids if _proc_name(p) == want] or list(victim.pids)
            pid = rng.choice(pids)
            what = f"{victim.id}/{_proc_name(pid)}"
            t = time.monotonic()
            st.kills.append(t)
            os.kill(pid, signal.SIGKILL)
            back = None
            while time.monotonic() < t + 60:
                await asyncio.sleep(0.2)
                r = next(r for r in _replicas(sup_addr) if r.id == victim.id)
                if r.state == pb.supervisor.REPLICA_STATE_READY and pid not in r.pids:
                    back = time.monotonic() - t
                    break
            log.append({"at_s": round(t - st.t0, 1), "killed": what, "pid": pid,
                        "ready_again_after_s": round(back, 2) if back is not None else None})
            print(f"[soak] t={t - st.t0:.0f}s killed {what} (pid {pid}); ready again after "
                  f"{back if back is None else round(back, 1)} s", flush=True)
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - st.kills[-1])))


async def _sampler(sup_addr: str, sup_pid: int, deadline: float, series: dict) -> None:
    while time.monotonic() < deadline:
        await asyncio.to_thread(_sample_memory, sup_addr, sup_pid, series)
        await asyncio.sleep(5)


def _growth(series: dict, warmup_until: float) -> dict:
    out = {}
    for key, samples in sorted(series.items()):
        samples = [s for s in samples if s[0] >= warmup_until] or samples
        last_pid = samples[-1][1]
        same = [s for s in samples if s[1] == last_pid]
        out[key] = {"first_mb": round(same[0][2], 1), "last_mb": round(same[-1][2], 1),
                    "growth_mb": round(same[-1][2] - same[0][2], 1),
                    "max_mb": round(max(s[2] for s in samples), 1),
                    "restarted": len({s[1] for s in samples}) > 1,
                    "samples_mb": [round(s[2], 1) for s in samples]}
    return out


def _engine_counters(svc: dict) -> dict:
    totals = Counter()
    for name, addr in svc.items():
        if name == "scheduler" or (name.startswith("scheduler-") and "metrics" not in name):
            try:
                with grpc.insecure_channel(addr) as ch:
                    load = pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(),
                                                                 timeout=5)
                totals["aborts"] += load.aborts
                totals["tokens_after_abort"] += load.tokens_after_abort
            except grpc.RpcError:
                totals["unreachable"] += 1
    return dict(totals)


def _gateway_counters(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("meshllm:gateway_requests_moved_before_first_token",
                            "meshllm:gateway_routed_requests_total")):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("meshllm:")] = float(value)
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3) \
        if len(values) > 1 else round(values[0], 3)


async def run(args) -> dict:
    from services.models import prepare_model
    model_dir = args.model or str(prepare_model("smollm2"))
    flags = ["--data-parallel-size", "2", "--tokenizer-replicas", "2", "--max-num-seqs", "64"]
    if not args.real_worker:
        flags += ["--simulate-worker", "--simulate-step-ms", str(args.step_ms)]
    t_start = time.monotonic()
    mesh = start_mesh(model_dir, *flags)
    print(f"[soak] mesh up in {time.monotonic() - t_start:.1f}s at {mesh.http_url}", flush=True)
    svc = mesh.services()
    sup_addr = svc["supervisor"]
    sup_pid = next(p for p in mesh.service_pids() if _proc_name(p) == "supervisor")
    pids_before = set(mesh.service_pids())
    st, kills, series = Stats(), [], {}
    st.blame_window_s = args.blame_window_s
    st.t0 = time.monotonic()
    deadline = st.t0 + args.duration_s
    rng = random.Random(args.seed)
    try:
        results = await asyncio.gather(
            _load(mesh.http_url, args.concurrency, deadline, st, args.seed, args.timeout_s),
            _inject(sup_addr, args.failure_every_s, deadline, st, rng, kills),
            _sampler(sup_addr, sup_pid, deadline, series))
        replicas = _replicas(sup_addr)
        engine = _engine_counters(svc)
        gateway = _gateway_counters(mesh.http_url)
    finally:
        rc = mesh.stop()
    all_pids = pids_before | {pid for s in series.values() for _, pid, _ in s}
    left = sorted(p for p in all_pids if alive(p))
    elapsed = time.monotonic() - st.t0
    return {
        "config": {"duration_s": args.duration_s, "concurrency": args.concurrency,
                   "failure_every_s": args.failure_every_s,
                   "worker": "real SmolLM2" if args.real_worker else f"simulated {args.step_ms} ms/step",
                   "replicas": 2, "tokenizer_replicas": 2, "seed": args.seed},
        "requests": results[0], "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(results[0] / elapsed, 1),
        "outcomes": dict(st.outcomes),
        "errors_by_kind": dict(st.errors),
        "errors_after_injected_failures": dict(st.errors_blamed),
        "latency_s": {"e2e_p50": _pct(st.e2e, 50), "e2e_p99": _pct(st.e2e, 99),
                      "ttft_p50": _pct(st.ttft, 50), "ttft_p99": _pct(st.ttft, 99),
                      "completed": len(st.e2e)},
        "injected_failures": kills,
        "supervisor_restarts": {r.id: r.restarts for r in replicas if r.restarts},
        "replica_states_at_end": {r.id: pb.supervisor.ReplicaState.Name(r.state) for r in replicas},
        "engine": engine, "gateway": gateway,
        "memory_rss": _growth(series, st.t0 + args.warmup_s),
        "launcher_exit_code": rc, "processes_left_behind": left,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--failure-every-s", type=float, default=60.0)
    p.add_argument("--blame-window-s", type=float, default=10.0,
                   help="errors of requests started up to this long after a kill count as its")
    p.add_argument("--warmup-s", type=float, default=20.0, help="memory growth is measured after it")
    p.add_argument("--timeout-s", type=float, default=60.0, help="a request this slow is a hang")
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated worker step time")
    p.add_argument("--real-worker", action="store_true", help="run SmolLM2 instead of simulating")
    p.add_argument("--model", default=None, help="model dir (default: the bundled SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = p.parse_args()
    if args.duration_s <= 0 or args.concurrency < 1 or args.failure_every_s <= 0:
        p.error("--duration-s, --concurrency and --failure-every-s must be positive")
    report = asyncio.run(run(args))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"[soak] wrote {args.out}")


if __name__ == "__main__":
    main()
