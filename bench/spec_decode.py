"""Speculative decoding, side by side in one run: output tok/s of the worker driven in-process by the
real scheduler core (async scheduling: two steps in flight, as the engine runs them), speculation
off vs each method, on an input-grounded workload (repeat / edit / continue a given text), and
on a random-weight model where nothing is accepted (dynamic K must turn itself off).

  .venv/bin/python bench/spec_decode.py --model-dir DIR [--device cpu|cuda] [--concurrency 1 32]
  python3 bench/spec_decode.py --gguf FILE --device cuda ...     (SmolLM2 on the GPU, from the GGUF)
  python3 bench/spec_decode.py --random-8b --device cuda --concurrency 256 --methods off,ngram

Methods: off, ngram (on a GPU its steps are fed from the device: spec/device_steps.py), ngram_host
(the same proposer with MESHLLM_DEVICE_DRAFTS=0: drafts made on the host after the previous step is
read), suffix (device-fed host chains: spec/device_chains.py), suffix_host (MESHLLM_DEVICE_DRAFTS=0),
draft_model. Each row reports host_ms: the mean host time of the worker's submits
(device-fed or not) and collects; --profile-submits adds the top functions of a cProfile of them (submits and collects).
Greedy outputs with speculation must equal those without (checked). Writes --out (JSON)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections import deque

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from services.common import pb  # noqa: E402
from services.common.spec_config import parse_spec_config  # noqa: E402
from services.scheduler import wire  # noqa: E402
from services.scheduler.core import Request, Scheduler, SchedulerConfig  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from services.worker.spec.decoder import SpecDecoder  # noqa: E402
from services.worker.wire import ProtoRunner  # noqa: E402

TEXTS = [
    "The printing press, invented by Johannes Gutenberg around 1440, allowed books to be produced "
    "quickly and cheaply. Before it, a single copy of a long book could take a scribe many months, and "
    "only monasteries, universities and the very rich owned more than a handful. Within fifty years of "
    "the first printed Bible, printing shops were working in more than two hundred European towns, and "
    "millions of volumes were in circulation. Prices fell, literacy rose, and for the first time the same "
    "text, with the same pages and the same errors, could be read by thousands of people in different "
    "countries. Scholars could compare their work, merchants could share price lists, and reformers could "
    "spread pamphlets faster than any authority could answer them.",
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\n"
    "def merge_sort(items):\n    if len(items) <= 1:\n        return list(items)\n    mid = len(items) // 2\n"
    "    left = merge_sort(items[:mid])\n    right = merge_sort(items[mid:])\n    return merge(left, right)\n\n\n"
    "def is_sorted(items):\n    return all(items[k] <= items[k + 1] for k in range(len(items) - 1))\n",
    "Dear team, the planning meeting on Thursday is moved to Friday at ten in the large room on the third "
    "floor. Please bring the quarterly report, the budget draft for next year and your notes from the "
    "customer visits in March. Maria will present the results of the survey, and Tom will walk us through "
    "the new release schedule. If you cannot attend, send your questions to me by Thursday evening so that "
    "we can answer them during the meeting. Lunch will be served after the meeting, so let me know if you "
    "have any dietary needs. Thanks, and see you on Friday. Anna.",
]
TASKS = ["Repeat the following text exactly:\n{}", "Fix any typos and return the full text:\n{}",
         "Copy this text, word for word:\n{}"]
METHODS = {"off": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
           # the same proposer, drafting on the host after the previous step is read (no device-fed steps)
           "ngram_host": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
           "suffix": {"method": "suffix", "num_speculative_tokens": 4},
           "suffix_host": {"method": "suffix", "num_speculative_tokens": 4},
           # the draft model's directory is filled in by main(): --draft-model, or the model drafting for itself
           "draft_model": {"method": "draft_model", "num_speculative_tokens": 4}}


def chat_ids(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids


PROFILER = None   # cProfile.Profile of the submits (--profile-submits)
PROFILE: dict[str, list[float]] = {}   # host seconds per submit (device-fed or not) and per collect
# --time-parts: host functions of a submit timed one by one (module, class or None, function)
PARTS = [("services.worker.spec.device_steps", None, "launch"), ("services.worker.spec.device_steps", None, "fed_plan"),
         ("services.worker.spec.device_ngram", "DeviceNgram", "sync"),
         ("services.worker.spec.device_chains", "DeviceChains", "host_chains"),
         ("services.worker.sampling", None, "to_device"), ("services.worker.gpu_fed", None, "run_fed"),
         ("services.worker.gpu_fed", None, "_stage"), ("services.worker.kernels.spec_fed", None, "feed"),
         ("services.worker.kernels.spec_fed", None, "commit"), ("services.worker.sampling", None, "sample_async"),
         ("torch.cuda", "CUDAGraph", "replay"), ("services.worker.runner", "ModelRunner", "_launch")]


def time_parts() -> dict[str, list[float]]:
    """Wrap PARTS with timers (seconds per call, appended to the returned dict) for the rest of
    the process; a name with no calls was not on the path."""
    import functools
    import importlib
    got: dict[str, list[float]] = {}
    for mod, cls, fn in PARTS:
        owner = importlib.import_module(mod)
        owner = getattr(owner, cls) if cls else owner
        orig = getattr(owner, fn)
        key = f"{cls or mod.rsplit('.', 1)[-1]}.{fn}"

        def timed(*args, _orig=orig, _key=key, **kw):
            t = time.perf_counter()
            try:
                return _orig(*args, **kw)
            finally:
                got.setdefault(_key, []).append(time.perf_counter() - t)
        setattr(owner, fn, functools.wraps(orig)(timed))
    return got


def drive(runner: ModelRunner, prompts: list[list[int]], max_new: int, concurrency: int, spec_tokens: int,
          eos: frozenset[int], block_size: int, logprobs: int = 0,
          tops: dict | None = None) -> tuple[dict[str, list[int]], float, int]:
    """All prompts through the scheduler core, `concurrency` at once -> (outputs, seconds, steps).
    logprobs > 0: each emitted token's top entries go to tops[request id] (a list per token)."""
    info = runner.hello(block_size)
    cfg = SchedulerConfig(max_model_len=runner.model.max_model_len, max_num_seqs=concurrency,
                          max_num_batched_tokens=max(2048, concurrency * 8), block_size=block_size,
                          num_spec_tokens=spec_tokens)
    s = Scheduler(cfg, info.num_kv_blocks, eos, info.vocab_size)
    for i, p in enumerate(prompts):
        sp = pb.common.SamplingParams(max_tokens=max_new, logprobs=logprobs) if logprobs else \
            pb.common.SamplingParams(max_tokens=max_new)
        s.add_request(Request(f"r{i}", list(p), max_new, sampling=sp))

    def take(out) -> None:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if tops is not None:
            tops.setdefault(out.request_id, []).extend([(t.token_id, t.logprob) for t in lp.top]
                                                       for lp in out.logprobs)
    wired = ProtoRunner(runner)
    PROFILE.clear()
    outputs: dict[str, list[int]] = {}
    inflight: deque = deque()
    steps = 0
    t0 = time.perf_counter()
    while inflight or s.has_work():
        if len(inflight) < 2 and s.has_work():
            t_s = time.perf_counter()
            plan = s.schedule()
            PROFILE.setdefault("schedule_s", []).append(time.perf_counter() - t_s)
            if not plan.is_empty():
                msg = wire.plan_to_proto(plan).plan
                fed = runner.spec is not None and runner.spec.fed_steps
                t_sub = time.perf_counter()
                if PROFILER is not None:
                    PROFILER.enable()
                inflight.append((plan, wired.submit(msg)))
                if PROFILER is not None:
                    PROFILER.disable()
                kind = "fed" if runner.spec is not None and runner.spec.fed_steps != fed else "host"
                PROFILE.setdefault(f"submit_{kind}_s", []).append(time.perf_counter() - t_sub)
                steps += 1
                if len(inflight) < 2:
                    continue
            else:
                for out in s.take_pending_outputs():
                    take(out)
        if inflight:
            plan, handle = inflight.popleft()
            t_col = time.perf_counter()
            if PROFILER is not None:
                PROFILER.enable()
            res = wired.collect(handle)
            if PROFILER is not None:
                PROFILER.disable()
            PROFILE.setdefault("collect_s", []).append(time.perf_counter() - t_col)
            if res.HasField("error"):
                raise RuntimeError(res.error.message)
            t_u = time.perf_counter()
            for out in s.update(plan, wire.result_from_proto(res)):
                take(out)
            PROFILE.setdefault("update_s", []).append(time.perf_counter() - t_u)
    if runner.model.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - t0, steps


def divergences(base: dict[str, list[int]], base_tops: dict, outs: dict[str, list[int]], tops: dict) -> list[dict]:
    """Per request whose greedy output differs from plain decoding's: where, and the top-2
    logprob gap of each run there (a near-tie flipped by bf16 numerics has a small gap)."""
    rows = []
    for rid, ref in base.items():
        got = outs.get(rid, [])
        j = next((k for k, (x, y) in enumerate(zip(ref, got)) if x != y), None)
        if j is None:
            if len(ref) == len(got):
                continue
            j = min(len(ref), len(got))
        row = {"request": rid, "at": j, "off_tokens": len(ref), "spec_tokens": len(got)}
        for name, t in (("off_gap", base_tops.get(rid, [])), ("spec_gap", tops.get(rid, []))):
            if j < len(t) and len(t[j]) >= 2:
                row[name] = t[j][0][1] - t[j][1][1]
        rows.append(row)
    return rows


def truncated_copy(model_dir, layers: int) -> str:
    """A copy of an HF model directory keeping its first `layers` decoder layers: a drafter
    with the same tokenizer, embeddings and head (the bench's stand-in for a smaller sibling)."""
    import shutil
    import tempfile
    from safetensors.torch import load_file, save_file
    src = pathlib.Path(model_dir)
    out = pathlib.Path(tempfile.mkdtemp(prefix=f"draft-{layers}l-"))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= layers:
                continue
            tensors[k] = v
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir")
    ap.add_argument("--gguf")
    ap.add_argument("--random-8b", action="store_true", help="Llama-3.1-8B shape, random bf16 weights (cuda)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--requests", type=int, default=0, help="per concurrency (default: max(3, concurrency))")
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--methods", default="off,ngram,suffix")
    ap.add_argument("--logprobs", type=int, default=0,
                    help="ask top-N logprobs (N >= 2: report the top-2 gap where greedy outputs diverge)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every method (its most, with --dynamic)")
    ap.add_argument("--dynamic", action="store_true", help="let the cost model choose K (default: always K)")
    ap.add_argument("--draft-model", help="method draft_model's directory (default: the model drafting for itself)")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="draft_model: a copy of the model keeping only its first N layers (a smaller drafter "
                         "with the same tokenizer)")
    ap.add_argument("--out", default="bench/results/spec_decode.json")
    ap.add_argument("--time-parts", action="store_true",
                    help="time PARTS (the device-fed submit's pieces) per call: each row's parts_ms (mean, p90, calls)")
    ap.add_argument("--profile-submits", action="store_true",
                    help="cProfile the worker's submits of the measured runs (top functions in the JSON)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    parts = time_parts() if a.time_parts else {}
    block = 16
    draft_dir = a.draft_model
    if a.random_8b:
        from gpu_decode import build_model, llama31_8b_config
        cfg = dataclasses.replace(llama31_8b_config(), eos_token_ids=(2,))
        model = build_model(cfg, 4096)
        tok_dir = pathlib.Path(a.model_dir) if a.model_dir else None
        name = "llama31-8b-random"
    else:
        from services.worker.models import load_model
        model_dir = a.model_dir
        if a.gguf:
            import tempfile

            from services.models.gguf_to_hf import convert_gguf_to_hf
            model_dir = convert_gguf_to_hf(a.gguf, pathlib.Path(tempfile.mkdtemp()))
        model = load_model(model_dir, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, 2048)
        draft_dir = a.draft_model or (truncated_copy(model_dir, a.draft_layers) if a.draft_layers else str(model_dir))
        tok_dir = pathlib.Path(model_dir)
        name = tok_dir.name
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str((tok_dir or pathlib.Path(a.model_dir)) / "tokenizer.json")) if tok_dir else None
    eos = frozenset(model.cfg.eos_token_ids)
    runner = ModelRunner(model, model_name=name, kv_cache_bytes=(8 << 30) if dev.type == "cuda" else (1 << 30),
                         block_size=block)
    runner.hello(block)
    res = {"bench": "spec_decode", "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "model": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "max_new": a.max_new,
           "dynamic_k": a.dynamic, "runs": []}
    for conc in a.concurrency:
        n = a.requests or max(3, conc)
        if tok is not None and not a.random_8b:
            prompts = [chat_ids(tok, TASKS[i % 3].format(TEXTS[i % 3])) for i in range(n)]
        else:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, 32000, (256,), generator=g).tolist() for _ in range(n)]
        base = None
        for method in a.methods.split(","):
            spec_json = METHODS[method]
            if spec_json is not None:
                spec_json = {**spec_json, "num_speculative_tokens": a.k}
            if spec_json is not None and not a.dynamic:
                spec_json = {**spec_json, "dynamic_k": [[1, 100000, spec_json["num_speculative_tokens"]]]}
            if spec_json is not None and spec_json["method"] == "draft_model":
                spec_json = {**spec_json, "model": draft_dir}
            spec = parse_spec_config(spec_json) if spec_json else None
            runner.spec = None
            os.environ["MESHLLM_DEVICE_DRAFTS"] = "0" if method.endswith("_host") else "1"
            os.environ["MESHLLM_DEVICE_CHAINS"] = "0" if method.endswith("_host") else "1"
            if spec is not None:
                draft = None
                if spec.method == "draft_model":
                    from services.worker.spec.draft_model import load_draft_model
                    draft = load_draft_model(spec, model, runner.num_blocks, block, dtype=model.dtype,
                                             max_num_tokens=runner.max_num_tokens, cuda_graphs=True)
                runner.enable_spec(SpecDecoder(spec, name, draft=draft))
                if a.dynamic:
                    runner.spec.calibrate(runner, max_tokens=512 if dev.type == "cuda" else 48)
            # warm-up at this concurrency's own batch (graphs, allocator, the cost model's first steps)
            drive(runner, prompts[:conc], 16, conc, spec.num_speculative_tokens if spec else 0, eos, block)
            tops: dict = {}
            parts.clear()
            global PROFILER
            if a.profile_submits:
                import cProfile
                PROFILER = cProfile.Profile()
            outs, secs, steps = drive(runner, prompts, a.max_new, conc, spec.num_speculative_tokens if spec else 0,
                                      eos, block, logprobs=a.logprobs, tops=tops)
            tokens = sum(len(v) for v in outs.values())
            row = {"concurrency": conc, "method": method, "requests": n, "output_tokens": tokens, "seconds": secs,
                   "output_tok_per_s": tokens / secs, "steps": steps}
            if PROFILER is not None:
                import io
                import pstats
                buf = io.StringIO()
                pstats.Stats(PROFILER, stream=buf).sort_stats("tottime").print_stats(40)
                row["submit_profile"] = buf.getvalue().splitlines()[-47:]
                buf = io.StringIO()
                pstats.Stats(PROFILER, stream=buf).sort_stats("cumulative").print_stats(40)
                row["submit_profile_cumulative"] = buf.getvalue().splitlines()[-47:]
                PROFILER = None
            row["host_ms"] = {k: {"calls": len(v), "mean": 1e3 * sum(v) / len(v)} for k, v in PROFILE.items() if v}
            for k, v in list(PROFILE.items()) + list(parts.items()):
                if v and (k in parts or k.startswith("submit")):
                    v = sorted(v)
                    row.setdefault("parts_ms" if k in parts else "host_ms_p90", {})[k] = (
                        {"mean": 1e3 * sum(v) / len(v), "p90": 1e3 * v[int(0.9 * (len(v) - 1))], "max": 1e3 * v[-1],
                         "calls": len(v)} if k in parts else 1e3 * v[int(0.9 * (len(v) - 1))])
            if runner.spec is not None:
                row.update(drafted=runner.spec.drafted, accepted=runner.spec.accepted, device_fed_steps=runner.spec.fed_steps,
                           acceptance=runner.spec.accepted / max(1, runner.spec.drafted))
            if base is None:
                base = (outs, row["output_tok_per_s"], tops)
            else:
                row["speedup_vs_off"] = row["output_tok_per_s"] / base[1]
                row["greedy_identical"] = outs == base[0]
                if not row["greedy_identical"] and a.logprobs >= 2:
                    row["divergences"] = divergences(base[0], base[2], outs, tops)
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            pathlib.Path(a.out).write_text(json.dumps(res, indent=1))
    ok = all(r.get("greedy_identical", True) for r in res["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
