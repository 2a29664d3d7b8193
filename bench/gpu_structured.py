"""Structured outputs on the GPU, in process (the worker's runner with step overlap, as the engine
drives it): is every constrained output valid, and what does the constraint cost per decode step
at batch 1 and 64, side by side with the same batch unconstrained, on the Llama-3.1-8B shape with
random bf16 weights. The grammar engine uses SmolLM2's tokenizer (its 49,152 ids; the model's
larger vocabulary is masked off above them).

  python3 bench/gpu_structured.py --tokenizer DIR/tokenizer.json [--steps 64] [--out FILE] [--revision LABEL]

Correctness: requests constrained by a bounded JSON schema, a regex and a choice list, greedy,
two steps in flight, each stopped at its EOS; their text must parse and match. Cost: `steps`
decode steps of `batch` requests whose schema never completes (an array of integers), so every
step computes real masks; interleaved free / constrained / free / constrained."""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_decode import BS, build_model, llama31_8b_config  # noqa: E402
from services.common import pb  # noqa: E402
from services.worker import structured  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from services.worker.wire import ProtoRunner  # noqa: E402

EOS = 2   # SmolLM2's, the grammar engine's end of output
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ENDLESS = {"type": "array", "items": {"type": "integer"}}


def constraint(**kind) -> pb.common.SamplingParams:
    return pb.common.SamplingParams(structured=pb.common.StructuredOutput(**kind))


def drive(wired: ProtoRunner, prompts: dict[str, tuple[list[int], pb.common.SamplingParams]], max_new: int,
          first_id: int, stop_at_eos: bool) -> tuple[dict[str, list[int]], list[float]]:
    """Prefill every prompt in one step, then decode with two steps in flight (the engine's overlap):
    -> outputs per request, wall ms per decode step."""
    free = list(range(wired.runner.num_blocks))
    need = -(-(max(len(p) for p, _ in prompts.values()) + max_new + 2) // BS)
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    plan = pb.step.StepPlan(step_id=first_id)
    for rid, (ids, sp) in prompts.items():
        plan.new_requests.add(request_id=rid, token_ids=ids, block_ids=[free.pop() for _ in range(need)],
                              num_scheduled_tokens=len(ids), sampling=sp)
    lengths = {rid: len(ids) for rid, (ids, _) in prompts.items()}
    live, done, step_ms, inflight = set(prompts), [], [], []
    planned = {rid: 1 for rid in prompts}   # outputs planned (the pending one included)
    inflight.append(wired.submit(plan))
    step_id, last = first_id + 1, time.perf_counter()
    while inflight:
        ahead = [rid for rid in live if planned[rid] < max_new]
        if ahead:
            plan = pb.step.StepPlan(step_id=step_id, finished_ids=done)
            done = []
            for rid in ahead:
                plan.cached_requests.add(request_id=rid, num_computed_tokens=lengths[rid] + planned[rid] - 1,
                                         num_scheduled_tokens=1)
                planned[rid] += 1
            inflight.append(wired.submit(plan))
            step_id += 1
        res = wired.collect(inflight.pop(0))
        assert not res.HasField("error"), res.error.message
        now = time.perf_counter()
        step_ms.append((now - last) * 1e3)
        last = now
        for o in res.outputs:
            if o.request_id in live and o.token_ids:
                outs[o.request_id].extend(o.token_ids)
                if (stop_at_eos and o.token_ids[-1] == EOS) or len(outs[o.request_id]) >= max_new:
                    live.discard(o.request_id)
                    done.append(o.request_id)
    wired.execute(pb.step.StepPlan(step_id=step_id, finished_ids=done + list(live)))
    return outs, step_ms[1:]   # the first is the prefill


def check_person(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"name", "age"} and isinstance(v["name"], str)
            and len(v["name"]) <= 10 and isinstance(v["age"], int) and 0 <= v["age"] <= 120)


def main() -> int:
    from tokenizers import Tokenizer
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default="bench/results/gpu_structured.json")
    p.add_argument("--revision", default="worktree", help="a label for the code measured")
    a = p.parse_args()
    tok = Tokenizer.from_file(a.tokenizer)
    # EOS of the grammar's tokenizer: the random model's own (Llama-3 ids) are not in SmolLM2's vocabulary.
    cfg = dataclasses.replace(llama31_8b_config(), eos_token_ids=(EOS,))
    model = build_model(cfg, 4096)
    runner = ModelRunner(model, model_name="llama31-8b-random", kv_cache_bytes=8 << 30, block_size=BS,
                         tokenizer_path=a.tokenizer)
    runner.hello(BS)
    wired = ProtoRunner(runner)
    assert runner.overlap, "the GPU runner overlaps steps"
    prompt = tok.encode("Give me a JSON record.").ids
    reqs = {f"person{i}": (prompt + [100 + i], constraint(json_schema=json.dumps(PERSON))) for i in range(4)}
    reqs["regex"] = (prompt, constraint(regex=r"[a-z]{3,8}-[0-9]{2}"))
    reqs["choice"] = (prompt, constraint(choice=pb.common.ChoiceList(choices=["red", "green", "blue"])))
    reqs["free"] = (prompt, pb.common.SamplingParams())
    t0 = time.perf_counter()
    outs, _ = drive(wired, reqs, 48, 0, stop_at_eos=True)
    texts = {rid: tok.decode([t for t in ids if t != EOS]) for rid, ids in outs.items()}
    valid = {rid: (check_person(texts[rid]) if rid.startswith("person") else
                   bool(re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", texts[rid])) if rid == "regex" else
                   texts[rid] in ("red", "green", "blue") if rid == "choice" else True)
             for rid in outs}
    ended = {rid: bool(outs[rid]) and outs[rid][-1] == EOS for rid in outs if rid != "free"}
    print("correctness", {"valid": valid, "ended_with_eos": ended}, f"{time.perf_counter() - t0:.1f}s", flush=True)
    cost = {}
    parallel_rows = getattr(structured, "PARALLEL_MIN_ROWS", None)   # absent in older revisions
    kinds = ("free", "constrained") + (("serial_masks",) if parallel_rows is not None else ())
    for batch in (1, 16, 64):
        runs: dict[str, list[float]] = {k: [] for k in kinds}
        mask_ms: dict[str, list[float]] = {k: [] for k in kinds}
        for kind in kinds * 2:
            sp = pb.common.SamplingParams() if kind == "free" else constraint(json_schema=json.dumps(ENDLESS))
            if parallel_rows is not None:
                structured.PARALLEL_MIN_ROWS = 10**9 if kind == "serial_masks" else parallel_rows
            batch_reqs = {f"{kind}{batch}-{i}-{len(runs[kind])}": (prompt + [200 + i], sp) for i in range(batch)}
            mask0 = runner.constraints.mask_s
            _, ms = drive(wired, batch_reqs, a.steps, 10_000, stop_at_eos=False)
            runs[kind].append(statistics.median(ms[4:]))
            mask_ms[kind].append((runner.constraints.mask_s - mask0) * 1e3 / a.steps)
        med = {k: statistics.median(v) for k, v in runs.items()}
        cost[str(batch)] = {"step_ms": runs, "median_step_ms": med, "host_mask_ms_per_step": mask_ms,
                            "mask_us_per_token": {k: 1e3 * statistics.median(v) / batch for k, v in mask_ms.items()},
                            "ratio_constrained_over_free": med["constrained"] / med["free"]}
        if "serial_masks" in med:
            cost[str(batch)]["ratio_serial_masks_over_free"] = med["serial_masks"] / med["free"]
        print("cost batch", batch, json.dumps(cost[str(batch)]), flush=True)
    res = {"schema": 1, "bench": "gpu_structured", "device": torch.cuda.get_device_name(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": "Llama-3.1-8B shape, random bf16",
           "grammar_tokenizer": "SmolLM2 (49,152 ids)", "overlap": runner.overlap,
           "revision": a.revision, "correctness": {"valid": valid, "ended_with_eos": ended}, "cost": cost}
    pathlib.Path(a.out).write_text(json.dumps(res, indent=2))
    return 0 if all(valid.values()) and all(ended.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
