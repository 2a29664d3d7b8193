"""One-H200 benchmark of the GPU worker on a Llama-3.1-8B-shaped model with seeded random bf16
weights built in-process (no files): ceilings, decode step time vs the memory floor, offline
throughput, TTFT vs the compute floor; `--peer` runs the transformers peer on the same weights.

  python3 bench/gpu_decode.py --out bench/results/gpu_decode.json
  python3 bench/gpu_decode.py --peer --out peer.json      # separate process (bounded by `timeout`)

Drives the ModelRunner in-process with handmade step.proto plans through the worker's wire edge
(wire.ProtoRunner: the engine loop's conversions, no sockets, no scheduler process), both one step at a time (execute) and pipelined as the worker's engine loop runs it with async
scheduling (submit step N+1, then collect step N: host work hidden behind the GPU). Runs the
decode and offline measurements with a bf16 KV cache and again with an fp8 one.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.common import pb  # noqa: E402
from services.worker.models.config import ModelConfig, RopeScaling  # noqa: E402
from services.worker.models.llama import LayerWeights, LlamaModel  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from services.worker.wire import ProtoRunner  # noqa: E402
from bench.compile_log import CompileLog  # noqa: E402

BS = 16
COPY_TBPS_NOMINAL = 4.3e12
GEMM_FLOPS_NOMINAL = 790e12


def llama31_8b_config() -> ModelConfig:
    return ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 131072, False,
                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), eos_token_ids=(128001, 128009))


def build_model(cfg: ModelConfig, max_len: int, seed: int = 0) -> LlamaModel:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = torch.device("cuda"), torch.bfloat16

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt) * std

    def norm(n):
        return 1.0 + w(n, std=0.1)

    h, i, nh, kvh, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = [LayerWeights(input_norm=norm(h), qkv=w((nh + 2 * kvh) * d, h), qkv_bias=None, o=w(h, nh * d),
                           post_norm=norm(h), gate_up=w(2 * i, h), down=w(h, i)) for _ in range(cfg.num_layers)]
    return LlamaModel(cfg, w(cfg.vocab_size, h), layers, norm(h), w(cfg.vocab_size, h), max_len)


def n_params(m: LlamaModel) -> int:
    ts = [m.embed, m.lm_head, m.final_norm]
    for lw in m.layers:
        ts += [lw.input_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down]
    return sum(t.numel() for t in ts)


def cuda_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceilings() -> dict:
    n = 2 ** 30  # 2 GiB of bf16 per buffer; rotate 2 pairs so L2 never holds them
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    k = [0]

    def copy():
        k[0] ^= 1
        bufs[2 + k[0]].copy_(bufs[k[0]])
    ms = cuda_time_ms(copy, 20)
    bw = 2 * n * 2 / (ms / 1e3)
    del bufs
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gms = cuda_time_ms(lambda: a @ b, 20)
    return {"copy_bytes_per_s": bw, "copy_ms_4GiB_rw": ms, "gemm_bf16_8192_flops": 2 * 8192 ** 3 / (gms / 1e3),
            "gemm_ms": gms}


class Reqs:
    """Request ids, block allocation and StepPlan building for the in-process loops."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.step = 0

    def plan(self) -> pb.step.StepPlan:
        self.step += 1
        return pb.step.StepPlan(step_id=self.step)

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BS)
        if n > len(self.free):
            raise RuntimeError("out of KV blocks")
        return [self.free.pop() for _ in range(n)]


GREEDY = pb.common.SamplingParams(temperature=0.0, ignore_eos=True)


def run(runner: ModelRunner, plan: pb.step.StepPlan) -> pb.step.StepResult:
    res = ProtoRunner(runner).execute(plan)
    if res.HasField("error"):
        raise RuntimeError(res.error.message)
    return res


def checked(res: pb.step.StepResult) -> pb.step.StepResult:
    if res.HasField("error"):
        raise RuntimeError(res.error.message)
    return res


def decode_steps(runner: ModelRunner, reqs: Reqs, batch: int, ctx: int, steps: int, gen) -> dict:
    """`batch` requests whose first ctx - steps tokens are already cached (random KV), then
    `steps` decode steps one at a time and `steps` pipelined: mean context = ctx."""
    start = ctx - steps
    plan = reqs.plan()
    ids = []
    for i in range(batch):
        rid = f"d{batch}-{i}"
        ids.append(rid)
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (start,), generator=gen).tolist(),
                              block_ids=reqs.blocks(start + 2 * steps + 1), num_computed_tokens=start - 1,
                              num_scheduled_tokens=1, sampling=GREEDY)
    run(runner, plan)
    wall = []
    for s in range(steps):
        plan = reqs.plan()
        for rid in ids:
            plan.cached_requests.add(request_id=rid, num_computed_tokens=start + s, num_scheduled_tokens=1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(runner, plan)
        wall.append((time.perf_counter() - t0) * 1e3)
    # GPU time alone: replay the bucket's graph on the last step's staged inputs.
    graph = runner.gpu.graphs.get(batch)
    replay_ms = cuda_time_ms(graph[0].replay, 20) if graph else None
    # Pipelined, as the engine loop runs with async scheduling: step s+1 is submitted before
    # step s is collected, its input ids read from the sampler's device buffer.
    # Collections meanwhile are timed (the worker freezes its heap after start-up; this loop's
    # process may not have), as is each result's interval.
    wired = ProtoRunner(runner)
    gc_s = [0.0, 0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_s[1] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_s[1]
    gc.callbacks.append(on_gc)
    torch.cuda.synchronize()
    t0 = last = time.perf_counter()
    gaps = []
    pending = None
    for s in range(steps, 2 * steps):
        plan = reqs.plan()
        for rid in ids:
            plan.cached_requests.add(request_id=rid, num_computed_tokens=start + s, num_scheduled_tokens=1)
        nxt = wired.submit(plan)
        if pending is not None:
            checked(wired.collect(pending))
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()
        pending = nxt
    checked(wired.collect(pending))
    pipelined_ms = (time.perf_counter() - t0) * 1e3 / steps
    gc.callbacks.remove(on_gc)
    done = reqs.plan()
    done.finished_ids.extend(ids)
    run(runner, done)
    return {"batch": batch, "mean_context": ctx, "step_ms_median": statistics.median(wall),
            "step_ms_pipelined": pipelined_ms, "graph_replay_ms": replay_ms,
            "pipelined_result_ms_median": statistics.median(gaps[1:]) * 1e3 if len(gaps) > 1 else None,
            "pipelined_result_ms_max": max(gaps) * 1e3 if gaps else None, "pipelined_gc_s": gc_s[0]}


def mixed_parts(runner: ModelRunner, reqs: Reqs, batch: int, ctx: int, prompts: int, prompt_len: int, gen,
                reps: int = 5) -> dict:
    """A chunked-prefill step mixed with decodes against its parts, one at a time (median of reps):
    `batch` decode rows at context ~ctx alone (a graph replay), `prompts` whole prompts of
    prompt_len alone (eager), and both in one step (eager). The issue's bar: mixed <= the sum."""
    start = ctx - 3 * reps - 2
    plan = reqs.plan()
    ids = [f"m{batch}-{i}" for i in range(batch)]
    for rid in ids:
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (start,), generator=gen).tolist(),
                              block_ids=reqs.blocks(ctx + 1), num_computed_tokens=start - 1,
                              num_scheduled_tokens=1, sampling=GREEDY)
    run(runner, plan)
    pos = [start]
    from services.worker import gpu_exec
    times: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": [], "mixed_one_launch": []}
    for r in range(reps):
        for kind in times:
            gpu_exec.SPLIT_MIXED = kind != "mixed_one_launch"
            plan = reqs.plan()
            if kind != "prefill":
                for rid in ids:
                    plan.cached_requests.add(request_id=rid, num_computed_tokens=pos[0], num_scheduled_tokens=1)
                pos[0] += 1
            new = []
            if kind != "decode":
                for j in range(prompts):
                    rid = f"mp{r}-{kind}-{j}"
                    new.append(rid)
                    plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (prompt_len,),
                                                                                  generator=gen).tolist(),
                                          block_ids=reqs.blocks(prompt_len + 1), num_scheduled_tokens=prompt_len,
                                          sampling=GREEDY)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            checked(run(runner, plan))
            times[kind].append((time.perf_counter() - t0) * 1e3)
            fin = reqs.plan()
            fin.finished_ids.extend(new)
            run(runner, fin)
    gpu_exec.SPLIT_MIXED = True
    done = reqs.plan()
    done.finished_ids.extend(ids)
    run(runner, done)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "ctx": ctx, "prompts": prompts, "prompt_len": prompt_len,
            **{f"{k}_ms": v for k, v in med.items()},
            "mixed_over_sum": med["mixed"] / (med["decode"] + med["prefill"]),
            "one_launch_over_sum": med["mixed_one_launch"] / (med["decode"] + med["prefill"])}


def ttft(runner: ModelRunner, reqs: Reqs, prompt_len: int, gen, reps: int = 5) -> dict:
    times = []
    for r in range(reps + 1):
        plan = reqs.plan()
        rid = f"ttft{r}"
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (prompt_len,), generator=gen).tolist(),
                              block_ids=reqs.blocks(prompt_len + 1), num_scheduled_tokens=prompt_len, sampling=GREEDY)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(runner, plan)
        times.append((time.perf_counter() - t0) * 1e3)
        fin = reqs.plan()
        fin.finished_ids.append(rid)
        run(runner, fin)
    return {"prompt_len": prompt_len, "ttft_ms_median": statistics.median(times[1:]), "all_ms": times}


def offline(runner: ModelRunner, num_requests: int, max_seqs: int, in_len: int, out_len: int,
            token_budget: int, gen, time_cap_s: float, pipelined: bool = True, vocab: int = 128000,
            gc_census: bool = False, chunked: bool = True) -> dict:
    """Continuous batching of fixed-length requests (EOS ignored): decodes first, then prompts
    while the token budget and max_seqs allow; blocks for prompt + output up front. chunked (the
    scheduler's policy, services/scheduler/core/scheduler.py): the step's leftover budget takes
    the next chunk of prompts already started, then the first chunk of new ones, so every step
    fills its budget; else whole prompts only, admitted while one fits. Plans are made ahead like
    the scheduler's async scheduling (a request's outputs are counted when planned); pipelined: two
    steps in flight (submit N+1, collect N), else one. Prompt ids are drawn from [0, vocab)."""
    free = list(range(runner.num_blocks))
    need = -(-(in_len + out_len) // BS)
    waiting = list(range(num_requests))
    prompts = {i: torch.randint(0, vocab, (in_len,), generator=gen).tolist() for i in waiting}
    running: dict[str, list] = {}  # rid -> [outputs planned, blocks, prompt tokens planned]
    finished: list[str] = []
    out_tokens, steps, prefill_steps, max_batch = 0, 0, 0, 0
    inflight: list = []
    depth = 2 if pipelined else 1
    wired = ProtoRunner(runner)
    decode_gaps: list[float] = []    # time between consecutive results, by the step's kind
    prefill_gaps: list[float] = []
    gc_pauses: list[tuple[int, float]] = []   # (generation, seconds) of every collection meanwhile
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append((info["generation"], time.perf_counter() - gc_start[0]))
    gc.callbacks.append(on_gc)
    compiles = CompileLog().__enter__()
    slowest: list[tuple[float, int, int, int]] = []   # (seconds, step, prompts, decodes) of the slowest results
    t0 = last_done = time.perf_counter()
    while waiting or running or inflight:
        if (waiting or running) and len(inflight) < depth and time.perf_counter() - t0 < time_cap_s:
            plan = pb.step.StepPlan(step_id=steps, finished_ids=finished)
            finished = []
            budget = token_budget
            prompt_tokens = 0
            for rid, st in running.items():   # decodes
                if st[2] == in_len:
                    plan.cached_requests.add(request_id=rid, num_computed_tokens=in_len + st[0] - 1,
                                             num_scheduled_tokens=1)
                    st[0] += 1
                    budget -= 1
            for rid, st in running.items():   # prompts started in an earlier step: their next chunk
                if st[2] < in_len and budget > 0:
                    c = min(in_len - st[2], budget)
                    plan.cached_requests.add(request_id=rid, num_computed_tokens=st[2], num_scheduled_tokens=c)
                    st[2] += c
                    st[0] = 1 if st[2] == in_len else 0   # the last chunk samples the first output
                    budget -= c
                    prompt_tokens += c
            while (waiting and len(running) < max_seqs and budget >= (1 if chunked else in_len)
                   and len(free) >= need):
                i = waiting.pop(0)
                rid = f"o{i}"
                c = min(in_len, budget)
                running[rid] = [1 if c == in_len else 0, [free.pop() for _ in range(need)], c]
                plan.new_requests.add(request_id=rid, token_ids=prompts.pop(i), block_ids=running[rid][1],
                                      num_scheduled_tokens=c, sampling=GREEDY)
                budget -= c
                prompt_tokens += c
            prefill_steps += prompt_tokens > 0
            max_batch = max(max_batch, len(running))
            for rid in [r for r, st in running.items() if st[0] >= out_len]:
                free += running.pop(rid)[1]   # reused only by later steps: stream order keeps it safe
                finished.append(rid)
            inflight.append((wired.submit(plan), prompt_tokens > 0, steps, len(plan.new_requests),
                             len(plan.cached_requests)))
            steps += 1
            if len(inflight) < depth:
                continue
        if not inflight:
            break
        pending, has_prefill, step_no, n_new, n_cached = inflight.pop(0)
        res = checked(wired.collect(pending))
        out_tokens += sum(len(o.token_ids) for o in res.outputs)
        now = time.perf_counter()
        (prefill_gaps if has_prefill else decode_gaps).append(now - last_done)
        slowest = sorted(slowest + [(now - last_done, step_no, n_new, n_cached)], reverse=True)[:5]
        last_done = now
    wall = time.perf_counter() - t0
    compiles.__exit__(None, None, None)
    gc.callbacks.remove(on_gc)
    census = _gc_census() if gc_census else None    # the last requests are not finished yet
    run(runner, pb.step.StepPlan(step_id=steps + 1, finished_ids=finished + list(running)))
    return {"requests": num_requests, "completed_all": not waiting and not running, "in_len": in_len,
            "out_len": out_len, "max_num_seqs": max_seqs, "token_budget": token_budget, "pipelined": pipelined,
            "chunked_prompts": chunked,
            "output_tokens": out_tokens, "wall_s": wall, "output_tok_per_s": out_tokens / wall,
            "steps": steps, "prefill_steps": prefill_steps, "max_running": max_batch,
            # Where the wall time went: results of steps without / with prompt tokens.
            "decode_step_s_total": sum(decode_gaps), "prefill_step_s_total": sum(prefill_gaps),
            "decode_step_ms_median": statistics.median(decode_gaps) * 1e3 if decode_gaps else None,
            "decode_step_ms_pcts": _pcts(decode_gaps), "prefill_step_ms_pcts": _pcts(prefill_gaps),
            "decode_steps_over_2x_median_s": sum(g for g in decode_gaps if g > 2 * statistics.median(decode_gaps))
            if decode_gaps else None,
            "gc": {f"gen{g}": {"count": sum(1 for x, _ in gc_pauses if x == g),
                               "total_s": sum(d for x, d in gc_pauses if x == g),
                               "max_ms": max((d for x, d in gc_pauses if x == g), default=0.0) * 1e3} for g in (0, 1, 2)},
            "gc_frozen_objects": gc.get_freeze_count(), "gc_census": census,
            # The slowest results (seconds, step, prompts, decodes) and Triton compiles during the run.
            "slowest_steps": [(round(g, 4), i, p, d) for g, i, p, d in slowest],
            "triton_compiles": compiles.events if compiles.runtime is not None else "no compile hook"}


def _gc_census() -> dict:
    """The collector's generations now (sizes, the oldest one's commonest types) and one full
    collection timed: what a generation-2 pause has to walk."""
    import collections
    sizes = [len(gc.get_objects(g)) for g in (0, 1, 2)]
    old = gc.get_objects(2)
    top = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in old).most_common(15)
    del old
    t = time.perf_counter()
    freed = gc.collect()
    return {"sizes": sizes, "frozen": gc.get_freeze_count(), "gen2_top": top, "full_collect_ms": (time.perf_counter() - t) * 1e3,
            "full_collect_freed": freed, "threshold": gc.get_threshold()}


def _pcts(xs: list[float]) -> dict | None:
    """p10 / p50 / p90 / p99 / max of step intervals, in ms."""
    if not xs:
        return None
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, int(q / 100 * len(s)))] * 1e3 for q in (10, 50, 90, 99)} | {"max": s[-1] * 1e3}


def profile_step(runner: ModelRunner, reqs: Reqs, batch: int, ctx: int, gen, path: Path | None) -> list:
    """Eager decode step of `batch` rows under torch.profiler: top kernels by CUDA time."""
    from torch.profiler import ProfilerActivity, profile
    sizes, runner.gpu.graph_sizes = runner.gpu.graph_sizes, []  # eager (restored after)
    plan = reqs.plan()
    ids = [f"prof{batch}-{i}" for i in range(batch)]
    for rid in ids:
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (ctx,), generator=gen).tolist(),
                              block_ids=reqs.blocks(ctx + 4), num_computed_tokens=ctx - 1, num_scheduled_tokens=1,
                              sampling=GREEDY)
    run(runner, plan)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        plan = reqs.plan()
        for rid in ids:
            plan.cached_requests.add(request_id=rid, num_computed_tokens=ctx, num_scheduled_tokens=1)
        run(runner, plan)
    fin = reqs.plan()
    fin.finished_ids.extend(ids)
    run(runner, fin)
    runner.gpu.graph_sizes = sizes
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
        rows.append({"name": e.key[:90], "calls": e.count, "cuda_ms": e.device_time_total / 1e3})
    return rows


def prompt_plan(reqs: Reqs, gen, tag: str, prompts: int, prompt_len: int) -> tuple[pb.step.StepPlan, list[str]]:
    """A plan of `prompts` new requests of `prompt_len` random tokens each (one prefill step)."""
    plan = reqs.plan()
    ids = [f"p{tag}-{j}" for j in range(prompts)]
    for rid in ids:
        plan.new_requests.add(request_id=rid, token_ids=torch.randint(0, 128000, (prompt_len,), generator=gen).tolist(),
                              block_ids=reqs.blocks(prompt_len + 1), num_scheduled_tokens=prompt_len,
                              sampling=GREEDY)
    return plan, ids


def finish(runner: ModelRunner, reqs: Reqs, ids: list[str]) -> None:
    fin = reqs.plan()
    fin.finished_ids.extend(ids)
    run(runner, fin)


def prefill_walls(runner: ModelRunner, reqs: Reqs, gen, prompts: int, prompt_len: int, n: int = 3) -> list[float]:
    """Wall time (ms) of n standalone prefill steps, the device idle before and after each."""
    walls = []
    for r in range(n):
        plan, ids = prompt_plan(reqs, gen, f"w{r}", prompts, prompt_len)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(runner, plan)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        finish(runner, reqs, ids)
    return walls


def profile_prefill(runner: ModelRunner, reqs: Reqs, prompt_len: int, gen, prompts: int = 1, top: int = 10) -> dict | list:
    """One prefill step of `prompts` prompts of `prompt_len` tokens under torch.profiler: top
    kernels (a list, for one prompt as before), or with several prompts a dict with the kernels,
    the CUDA total and the step's wall time (median of 3 unprofiled runs)."""
    from torch.profiler import ProfilerActivity, profile
    plan, ids = prompt_plan(reqs, gen, "rofp", prompts, prompt_len)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(runner, plan)
    finish(runner, reqs, ids)
    avgs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    rows = [{"name": e.key[:90], "calls": e.count, "cuda_ms": e.device_time_total / 1e3} for e in avgs[:top]]
    if prompts == 1:
        return rows
    walls = prefill_walls(runner, reqs, gen, prompts, prompt_len)
    return {"prompts": prompts, "prompt_len": prompt_len, "kernels": rows,
            "cuda_ms_total": sum(e.device_time_total for e in avgs) / 1e3, "wall_ms_median": statistics.median(walls)}


def peer(args, save) -> dict:
    """transformers on the same weights: generate_batch (continuous batching) if it works, else
    static-batch generate."""
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    cfg = llama31_8b_config()
    model = build_model(cfg, 4096)
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    nh, kvh, d = 32, 8, 128
    P = torch.nn.Parameter
    with torch.no_grad():
        hf.model.embed_tokens.weight = P(model.embed, requires_grad=False)
        hf.lm_head.weight = P(model.lm_head, requires_grad=False)
        hf.model.norm.weight = P(model.final_norm, requires_grad=False)
        for lw, hl in zip(model.layers, hf.model.layers):
            a, m = hl.self_attn, hl.mlp
            a.q_proj.weight = P(lw.qkv[:nh * d], requires_grad=False)
            a.k_proj.weight = P(lw.qkv[nh * d:(nh + kvh) * d], requires_grad=False)
            a.v_proj.weight = P(lw.qkv[(nh + kvh) * d:], requires_grad=False)
            a.o_proj.weight = P(lw.o, requires_grad=False)
            m.gate_proj.weight = P(lw.gate_up[:14336], requires_grad=False)
            m.up_proj.weight = P(lw.gate_up[14336:], requires_grad=False)
            m.down_proj.weight = P(lw.down, requires_grad=False)
            hl.input_layernorm.weight = P(lw.input_norm, requires_grad=False)
            hl.post_attention_layernorm.weight = P(lw.post_norm, requires_grad=False)
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(1)
    n, in_len, out_len = args.peer_requests, args.in_len, args.out_len
    prompts = [torch.randint(0, 128000, (in_len,), generator=gen).tolist() for _ in range(n)]
    result = {"transformers": transformers.__version__, "requests": n, "in_len": in_len, "out_len": out_len}
    gc = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    # 1) static-batch generate (sdpa, dynamic cache) on the full workload
    x = torch.tensor(prompts, device="cuda")
    with torch.no_grad():
        hf.generate(x[:2, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    toks = int((out.shape[1] - in_len) * n)
    result["static_generate"] = {"batch": n, "output_tokens": toks, "wall_s": wall, "output_tok_per_s": toks / wall}
    save(result)
    del out, x
    torch.cuda.empty_cache()
    # 2) generate_batch (continuous batching), probed on a smaller workload: in an earlier run
    #    64 x 1024/1024 did not finish in 200 s.
    if hasattr(hf, "generate_batch"):
        pn, pout = args.peer_cb_requests, args.peer_cb_out_len
        try:
            gcb = GenerationConfig(max_new_tokens=pout, do_sample=False, eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = hf.generate_batch(prompts[:pn], generation_config=gcb)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            toks = sum(len(o.generated_tokens) for o in outs.values())
            result["generate_batch_probe"] = {"requests": pn, "in_len": in_len, "out_len": pout,
                                              "output_tokens": toks, "wall_s_incl_warmup": wall,
                                              "output_tok_per_s": toks / wall}
        except Exception as exc:  # noqa: BLE001
            result["generate_batch_probe"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        save(result)
    return result


def kv_runner(model: LlamaModel, kv_gib: float, kv_dtype) -> ModelRunner:
    runner = ModelRunner(model, model_name="llama31-8b-random", kv_cache_bytes=int(kv_gib * 2 ** 30), block_size=BS,
                         kv_cache_dtype=kv_dtype)
    runner.hello(BS)
    for kv in runner.kv_caches:  # random cached context, never time on zeros (in slices: little scratch)
        for i in range(0, kv.shape[1], 4096):
            part = kv[:, i:i + 4096]
            part.copy_(torch.randn(part.shape, device=kv.device, dtype=torch.bfloat16))
    return runner


def profile_replay(runner: ModelRunner, batch: int) -> list:
    """Kernels of one replay of the decode graph of `batch` rows (last staged inputs)."""
    from torch.profiler import ProfilerActivity, profile
    graph = runner.gpu.graphs[batch][0]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [{"name": e.key[:90], "calls": e.count, "cuda_ms": e.device_time_total / 1e3}
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_decode.json")
    p.add_argument("--peer", action="store_true")
    p.add_argument("--peer-cb-requests", type=int, default=16)
    p.add_argument("--peer-cb-out-len", type=int, default=32)
    p.add_argument("--peer-requests", type=int, default=64)
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-seqs", default="256", help="comma-separated: one offline run per value")
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--kv-gib", type=float, default=96.0)
    p.add_argument("--kv-dtypes", default="bf16,fp8", help="KV cache dtypes to run: bf16, fp8")
    p.add_argument("--offline-cap-s", type=float, default=150.0)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--offline-sync", action="store_true", help="also run offline one step at a time (bf16)")
    args = p.parse_args()
    out = Path(args.out)
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.peer:
        res = peer(args, lambda r: (out.write_text(json.dumps(r, indent=1)), print(json.dumps(r), flush=True)))
        return 0
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save():
        out.write_text(json.dumps(res, indent=1))

    res["ceilings"] = ceilings()
    bw = res["ceilings"]["copy_bytes_per_s"]
    save()
    print("ceilings", res["ceilings"], flush=True)
    cfg = llama31_8b_config()
    t0 = time.perf_counter()
    model = build_model(cfg, 4096)
    params = n_params(model)
    kv_elems_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    res["model"] = {"params": params, "weight_bytes": 2 * params, "kv_bytes_per_token": 2 * kv_elems_per_token,
                    "build_s": time.perf_counter() - t0}
    gen = torch.Generator().manual_seed(0)
    res["decode"], res["offline"] = [], []
    for kv_name in args.kv_dtypes.split(","):
        kv_dtype = {"bf16": None, "fp8": torch.float8_e4m3fn}[kv_name]
        kv_bytes = kv_elems_per_token * (1 if kv_dtype is not None else 2)
        runner = kv_runner(model, args.kv_gib, kv_dtype)   # captures every decode graph (start-up)
        res.setdefault("setup", {})[kv_name] = {"graph_capture_s": runner.graph_capture_s,
                                                "num_kv_blocks": runner.num_blocks, "graph_sizes": runner.gpu.graph_sizes}
        print("setup", kv_name, res["setup"][kv_name], flush=True)
        for b in (1, 64, 256):
            r = decode_steps(runner, Reqs(runner.num_blocks), b, 1536, 30, gen)
            floor = 2 * params + b * 1536 * kv_bytes
            r["kv_cache"] = kv_name
            r["floor_ms_at_4.3TBps"] = floor / COPY_TBPS_NOMINAL * 1e3
            r["floor_ms_at_measured_bw"] = floor / bw * 1e3
            for key in ("step_ms_median", "step_ms_pipelined", "graph_replay_ms"):
                if r.get(key):
                    r[f"{key}_ratio_to_floor_4.3"] = r[key] / r["floor_ms_at_4.3TBps"]
            res["decode"].append(r)
            save()
            print("decode", r, flush=True)
        if kv_dtype is None:
            r = ttft(runner, Reqs(runner.num_blocks), 1024, gen)
            r["compute_floor_ms_at_790T"] = 2 * params * 1024 / GEMM_FLOPS_NOMINAL * 1e3
            r["compute_floor_ms_at_measured"] = 2 * params * 1024 / res["ceilings"]["gemm_bf16_8192_flops"] * 1e3
            res["ttft"] = r
            save()
            print("ttft", r, flush=True)
            try:
                res["profile_decode_b1_replay"] = profile_replay(runner, 1)
            except Exception as exc:  # noqa: BLE001
                res["profile_error_replay"] = repr(exc)
        if kv_dtype is None:
            # The batch-1 GEMV kernel (kernels/gemv.py) against cuBLAS, same run: recapture b = 1.
            from services.worker.kernels import gemv as gemv_mod
            gemv_mod.ENABLED = False
            runner.gpu.graphs.pop(1, None)
            r = decode_steps(runner, Reqs(runner.num_blocks), 1, 1536, 30, gen)
            r["kv_cache"], r["gemv"] = kv_name, "cublas"
            res["decode_b1_cublas"] = r
            print("decode b1 cublas", r, flush=True)
            gemv_mod.ENABLED = True
            runner.gpu.graphs.pop(1, None)
        if not args.skip_offline:
            runs = [(int(m), True) for m in args.max_seqs.split(",")]
            if args.offline_sync and kv_dtype is None:
                runs.append((runs[0][0], False))
            for max_seqs, pipelined in runs:
                r = offline(runner, args.requests, max_seqs, args.in_len, args.out_len, args.token_budget, gen,
                            args.offline_cap_s, pipelined)
                r["kv_cache"] = kv_name
                res["offline"].append(r)
                save()
                print("offline", r, flush=True)
        if kv_dtype is None:
            try:
                res["profile_prefill_1024"] = profile_prefill(runner, Reqs(runner.num_blocks), 1024, gen)
                res["profile_decode_b1_eager"] = profile_step(runner, Reqs(runner.num_blocks), 1, 1536, gen, None)
                res["profile_decode_b256_eager"] = profile_step(runner, Reqs(runner.num_blocks), 256, 1536, gen, None)
            except Exception as exc:  # noqa: BLE001
                res["profile_error"] = repr(exc)
            save()
        del runner
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
