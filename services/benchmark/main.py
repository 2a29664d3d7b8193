"""`meshllm bench serve [flags]` and `meshllm bench compare A.json B.json`.

Flags follow `vllm bench serve`, so a command line moves between the two unchanged:

  meshllm bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
      --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 200 \\
      --max-concurrency 16 --ignore-eos --result-file out.json

Several values of --request-rate and/or --max-concurrency make a sweep (one run each)."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.benchmark.backends import BACKENDS, RequestOptions, make_backend
from services.benchmark.datasets import (DATASETS, load_tokenizer, prefix_requests, random_requests,
                                         sharegpt_sample_requests)
from services.benchmark.metrics import DEFAULT_PERCENTILES, PERCENTILE_METRICS, parse_goodput, summarize
from services.benchmark.runner import LoadShape, Progress, run_load, warm_up

SCHEMA = "meshllm.bench.serve/1"


class BenchError(Exception):
    """A clear, one-line reason the benchmark cannot run (exit code 1, no traceback)."""


@dataclass
class BenchConfig:
    backend: str = "openai"
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None
    model: str | None = None               # the model name sent in requests (or a local model dir)
    served_model_name: str | None = None
    tokenizer: str | None = None
    dataset_name: str = "random"
    num_prompts: int = 100
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefix_groups: int = 4
    sharegpt_output_len: int | None = None
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    max_concurrencies: list[int | None] = field(default_factory=lambda: [None])
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    num_warmups: int = 0
    goodput: dict[str, float] = field(default_factory=dict)
    percentile_metrics: list[str] = field(default_factory=lambda: list(PERCENTILE_METRICS))
    metric_percentiles: list[float] = field(default_factory=lambda: list(DEFAULT_PERCENTILES))
    result_file: str | None = None
    plot: bool = True
    save_detailed: bool = False
    progress: bool = True
    timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {DATASETS}")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if self.prefix_len < 1 or self.num_prefix_groups < 1:
            raise ValueError("--prefix-len and --num-prefix-groups must be >= 1")
        if any(not r > 0 for r in self.request_rates):
            raise ValueError("--request-rate must be > 0 (inf: send all at once)")
        if self.burstiness <= 0:
            raise ValueError("--burstiness must be > 0")
        if any(c is not None and c < 1 for c in self.max_concurrencies):
            raise ValueError("--max-concurrency must be >= 1")
        if self.num_warmups < 0:
            raise ValueError("--num-warmups must be >= 0")
        bad = [m for m in self.percentile_metrics if m not in PERCENTILE_METRICS]
        if bad:
            raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {list(PERCENTILE_METRICS)}")
        if any(not 0 < p < 100 for p in self.metric_percentiles):
            raise ValueError("--metric-percentiles must be in (0, 100)")


def _rates(values: list[str]) -> list[float]:
    try:
        return [math.inf if v.lower() == "inf" else float(v) for v in values]
    except ValueError:
        raise ValueError(f"--request-rate takes numbers or inf, got {values}") from None


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshllm bench serve",
                                description="load-test an OpenAI-compatible or meshllm gRPC endpoint")
    a = p.add_argument
    a("--backend", default="openai", choices=BACKENDS,
      help="openai: /v1/completions, openai-chat: /v1/chat/completions, meshllm-grpc: Generation.Generate")
    a("--base-url", default=None, help="http(s)://host:port of the server (gRPC: host:port)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=None, help="default 8000 (HTTP) or 50051 (meshllm-grpc)")
    a("--endpoint", default=None, help="API path (default /v1/completions or /v1/chat/completions)")
    a("--model", default=None, help="model name in requests, or a local model dir (its tokenizer is "
                                    "used and the name asked from the server); default: the server's first")
    a("--served-model-name", default=None, help="model name in requests when --model is a path")
    a("--tokenizer", default=None, help="model dir or tokenizer.json for exact prompt lengths")
    a("--dataset-name", default="random", choices=DATASETS)
    a("--num-prompts", type=int, default=100)
    a("--random-input-len", type=int, default=128)
    a("--random-output-len", type=int, default=64)
    a("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    a("--prefix-len", type=int, default=256, help="prefix dataset: shared prefix tokens")
    a("--num-prefix-groups", type=int, default=4, help="prefix dataset: distinct shared prefixes")
    a("--sharegpt-output-len", type=int, default=None, help="sharegpt-sample: override output lengths")
    a("--request-rate", nargs="+", default=["inf"],
      help="requests/s (Poisson); inf sends all at once; several values make a sweep")
    a("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 Poisson, <1 burstier")
    a("--max-concurrency", type=int, nargs="+", default=None, help="most requests in flight; several = sweep")
    a("--ignore-eos", action="store_true", help="generate exactly max_tokens (fixed output lengths)")
    a("--temperature", type=float, default=0.0)
    a("--seed", type=int, default=0)
    a("--num-warmups", type=int, default=0, help="requests run (and not measured) before each sweep")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 itl:50 e2el:5000 (itl: each request's p99)")
    a("--percentile-metrics", default=",".join(PERCENTILE_METRICS), help="comma list of ttft,tpot,itl,e2el")
    a("--metric-percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES), help="e.g. 50,90,99")
    a("--result-file", default=None, help="write the JSON result here (plots beside it)")
    a("--save-result", action="store_true", help="vLLM style: write the result to --result-dir/--result-filename")
    a("--result-dir", default=".")
    a("--result-filename", default=None)
    a("--save-detailed", action="store_true", help="also store every request's TTFT/TPOT/ITL/E2EL")
    a("--no-plot", action="store_true", help="do not write PNG plots")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (default $OPENAI_API_KEY)")
    return p


def parse_serve_args(argv: list[str]) -> BenchConfig:
    p = _serve_parser()
    a = p.parse_args(argv)
    port = a.port or (50051 if a.backend == "meshllm-grpc" else 8000)
    base = a.base_url or (f"{a.host}:{port}" if a.backend == "meshllm-grpc" else f"http://{a.host}:{port}")
    result_file = a.result_file
    if a.save_result and not result_file:
        name = a.result_filename or f"{a.backend}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        result_file = str(Path(a.result_dir) / name)
    try:
        return BenchConfig(
            backend=a.backend, base_url=base, endpoint=a.endpoint, model=a.model,
            served_model_name=a.served_model_name, tokenizer=a.tokenizer, dataset_name=a.dataset_name,
            num_prompts=a.num_prompts, random_input_len=a.random_input_len,
            random_output_len=a.random_output_len, random_range_ratio=a.random_range_ratio,
            prefix_len=a.prefix_len, num_prefix_groups=a.num_prefix_groups,
            sharegpt_output_len=a.sharegpt_output_len, request_rates=_rates(a.request_rate),
            burstiness=a.burstiness, max_concurrencies=a.max_concurrency or [None],
            ignore_eos=a.ignore_eos, temperature=a.temperature, seed=a.seed, num_warmups=a.num_warmups,
            goodput=parse_goodput(a.goodput),
            percentile_metrics=[m.strip() for m in a.percentile_metrics.split(",") if m.strip()],
            metric_percentiles=[float(x) for x in a.metric_percentiles.split(",") if x.strip()],
            result_file=result_file, plot=not a.no_plot, save_detailed=a.save_detailed,
            progress=not a.disable_tqdm, timeout_s=a.request_timeout, api_key=a.api_key)
    except ValueError as exc:
        p.error(str(exc))


def build_requests(cfg: BenchConfig, n: int, seed: int):
    try:
        tok = load_tokenizer(cfg.tokenizer, cfg.model)
    except (ValueError, OSError, Exception) as exc:  # tokenizers raises its own Exception type
        raise BenchError(f"cannot load the tokenizer: {exc}") from None
    if cfg.dataset_name == "random":
        return random_requests(n, cfg.random_input_len, cfg.random_output_len, cfg.random_range_ratio, seed, tok)
    if cfg.dataset_name == "prefix":
        return prefix_requests(n, cfg.prefix_len, cfg.num_prefix_groups, cfg.random_input_len,
                               cfg.random_output_len, seed, tok)
    return sharegpt_sample_requests(n, cfg.sharegpt_output_len, seed, tok)


async def discover_model(cfg: BenchConfig) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model and not os.path.isdir(cfg.model):
        return cfg.model
    if cfg.backend == "meshllm-grpc":
        import grpc

        from services.common import pb
        async with grpc.aio.insecure_channel(cfg.base_url.removeprefix("grpc://")) as ch:
            try:
                resp = await pb.generation_grpc.GenerationStub(ch).ListModels(
                    pb.generation.ListModelsRequest(), timeout=10)
            except grpc.aio.AioRpcError as err:
                raise BenchError(f"cannot list models at {cfg.base_url}: {err.details() or err.code().name}") from None
        names = [m.id for m in resp.models]
    else:
        from services.benchmark.http_client import ConnectError, HttpClient
        http = HttpClient(cfg.base_url)
        try:
            status, body = await asyncio.wait_for(http.get("/v1/models"), 10)
        except (ConnectError, OSError, asyncio.TimeoutError) as exc:
            raise BenchError(f"cannot reach {cfg.base_url}: {exc or type(exc).__name__}") from None
        finally:
            await http.close()
        if status != 200:
            raise BenchError(f"GET {cfg.base_url}/v1/models answered HTTP {status}")
        names = [m["id"] for m in json.loads(body).get("data", [])]
    if not names:
        raise BenchError(f"{cfg.base_url} serves no model")
    return names[0]


def _samples(results) -> dict:
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft * 1e3 for r in ok], "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
            "itl": [x * 1e3 for r in ok for x in r.itl], "e2el": [r.latency * 1e3 for r in ok]}


async def run_serve(cfg: BenchConfig, argv: list[str] | None = None) -> tuple[dict, list[dict]]:
    model = await discover_model(cfg)
    n_warm = max(cfg.num_warmups, 1)
    requests = build_requests(cfg, cfg.num_prompts, cfg.seed)
    warmups = build_requests(cfg, n_warm, cfg.seed + 1)
    opts = RequestOptions(model=model, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                          timeout_s=cfg.timeout_s)
    try:
        backend = make_backend(cfg.backend, cfg.base_url, cfg.endpoint, opts, cfg.api_key)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    runs, samples = [], []
    try:
        # One test request first (as vLLM does): a bad URL, model or endpoint stops here, clearly.
        probe = await backend.send(warmups[0])
        if not probe.success:
            raise BenchError(f"the test request to {cfg.base_url} (model {model!r}) failed: "
                             f"{probe.error_message or probe.error} [{probe.error}]")
        if cfg.num_warmups:
            print(f"warming up with {cfg.num_warmups} requests", file=sys.stderr)
            await warm_up(backend.send, warmups, max(c or 0 for c in cfg.max_concurrencies) or None)
        for rate, conc in itertools.product(cfg.request_rates, cfg.max_concurrencies):
            shape = LoadShape(request_rate=rate, burstiness=cfg.burstiness, max_concurrency=conc)
            label = f"rate={'inf' if math.isinf(rate) else f'{rate:g}'} conc={conc or 'unlimited'}"
            progress = Progress(len(requests), label, cfg.progress)
            results, duration = await run_load(backend.send, requests, shape, cfg.seed, progress)
            run = {"request_rate": None if math.isinf(rate) else rate, "burstiness": cfg.burstiness,
                   "max_concurrency": conc,
                   **summarize(results, duration, slos=cfg.goodput, percentiles=cfg.metric_percentiles,
                               metrics=cfg.percentile_metrics)}
            s = _samples(results)
            if cfg.save_detailed:
                run["samples_ms"] = s
            first_errors = {}
            for r in results:
                if not r.success and r.error not in first_errors:
                    first_errors[r.error] = r.error_message
            run["error_examples"] = first_errors
            runs.append(run)
            samples.append(s)
            print(format_run(run, cfg.metric_percentiles, cfg.percentile_metrics), flush=True)
    finally:
        await backend.close()
    return {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": "meshllm bench serve " + " ".join(argv or []),
            "host": {"platform": platform.platform(), "python": platform.python_version(),
                     "cpus": os.cpu_count()},
            "backend": cfg.backend, "base_url": cfg.base_url, "endpoint": backend_endpoint(cfg), "model": model,
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("api_key",)} | {
                "request_rates": [None if math.isinf(r) else r for r in cfg.request_rates]},
            "runs": runs}, samples


def backend_endpoint(cfg: BenchConfig) -> str:
    from services.benchmark.backends import DEFAULT_ENDPOINTS
    return "Generation.Generate" if cfg.backend == "meshllm-grpc" else (cfg.endpoint or DEFAULT_ENDPOINTS[cfg.backend])


def format_run(run: dict, percentiles, metrics) -> str:
    w = 50
    rate = "inf" if run["request_rate"] is None else f"{run['request_rate']:g}"
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="),
             f"{'Request rate (req/s):':<40}{rate:>10}",
             f"{'Max concurrency:':<40}{str(run['max_concurrency'] or '-'):>10}",
             f"{'Successful requests:':<40}{run['completed']:>10}",
             f"{'Failed requests:':<40}{run['failed']:>10}"]
    for kind, n in sorted(run["errors"].items()):
        lines.append(f"{'  ' + kind + ':':<40}{n:>10}")
    lines += [f"{'Benchmark duration (s):':<40}{run['duration_s']:>10.2f}",
              f"{'Total input tokens:':<40}{run['total_input_tokens']:>10}",
              f"{'Total generated tokens:':<40}{run['total_output_tokens']:>10}",
              f"{'Request throughput (req/s):':<40}{run['request_throughput']:>10.2f}",
              f"{'Output token throughput (tok/s):':<40}{run['output_throughput']:>10.2f}",
              f"{'Total token throughput (tok/s):':<40}{run['total_token_throughput']:>10.2f}"]
    if run["goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{run['goodput']:>10.2f}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for m in metrics:
        d = run[f"{m}_ms"]
        lines.append("{s:{c}^{n}}".format(s=names[m], n=w, c="-"))
        if d["mean"] is None:
            lines.append(f"{'(no samples)':<40}")
            continue
        lines.append(f"{'Mean ' + m.upper() + ' (ms):':<40}{d['mean']:>10.2f}")
        for p in percentiles:
            lines.append(f"{f'P{p:g} ' + m.upper() + ' (ms):':<40}{d[f'p{p:g}'.replace('.', '_')]:>10.2f}")
    lines.append("=" * w)
    return "\n".join(lines)


def write_outputs(result: dict, samples: list[dict], path: str, plot: bool) -> list[str]:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False, default=_json_default) + "\n")
    written = [str(out)]
    if plot:
        from services.benchmark import plots
        title = f"{result['model']} via {result['backend']} ({result['config']['dataset_name']})"
        stem = out.with_suffix("")
        written.append(str(plots.latency_cdf(result["runs"], samples, Path(f"{stem}-latency-cdf.png"), title)))
        if len(result["runs"]) > 1:
            written.append(str(plots.sweep(result["runs"], Path(f"{stem}-sweep.png"), title)))
    return written


def _json_default(v):
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def _nan_to_none(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def cmd_serve(argv: list[str]) -> int:
    cfg = parse_serve_args(argv)
    try:
        result, samples = asyncio.run(run_serve(cfg, argv))
    except BenchError as exc:
        print(f"meshllm bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meshllm bench: interrupted", file=sys.stderr)
        return 130
    result = _nan_to_none(result)
    if cfg.result_file:
        for f in write_outputs(result, samples, cfg.result_file, cfg.plot):
            print(f"wrote {f}")
    failed = sum(r["failed"] for r in result["runs"])
    return 0 if failed == 0 else 3


def cmd_compare(argv: list[str]) -> int:
    from services.benchmark.compare import CompareError, compare, load_result
    p = argparse.ArgumentParser(prog="meshllm bench compare",
                                description="compare two `meshllm bench serve` results (ratio = B / A)")
    p.add_argument("a")
    p.add_argument("b")
    a = p.parse_args(argv)
    try:
        ra, rb = load_result(a.a), load_result(a.b)
    except CompareError as exc:
        print(f"meshllm bench: error: {exc}", file=sys.stderr)
        return 1
    print(compare(ra, rb, Path(a.a).stem, Path(a.b).stem))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: meshllm bench {serve,compare} ...  (meshllm bench serve --help)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + usage)
        return 0 if argv else 2
    if argv[0] == "serve":
        return cmd_serve(argv[1:])
    if argv[0] == "compare":
        return cmd_compare(argv[1:])
    print(f"meshllm bench: unknown command {argv[0]!r}\n{usage}", file=sys.stderr)
    return 2
