"""FP8 weights (--quantization fp8) on one H200, side by side with bf16 weights in the same run,
on the Llama-3.1-8B shape with random weights (bench/gpu_decode.py's model and loops):

1. kernel checks at full shapes: the per-token quantiser against torch's e4m3 cast; every
   projection's FP8 product against the dequantised weights, at M = 1, 7, 64, 256;
2. decode step at batch 1 / 64 / 256 (mean context 1,536) for bf16 and FP8 weights with a bf16
   and an fp8 KV cache, against the memory floor (weight bytes + KV bytes at the measured copy
   bandwidth); FP8 weights both "fused" (producers quantise, consumers scale: the served path)
   and "separate" (one quantiser + row-wise-scaled GEMM per projection, models/llama_triton.FUSED_FP8);
3. offline 1k/1k (512 requests, --max-seqs at once: 256, or one run per value) for each
   weights:KV[:mode] asked for.

Per-kernel timings of the projections: bench/gpu_fp8_kernels.py.

  python3 bench/gpu_fp8.py [--offline bf16:fp8,fp8:fp8,fp8:fp8:separate] [--out bench/results/gpu_fp8.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import gpu_decode  # noqa: E402
from gpu_decode import (BS, COPY_TBPS_NOMINAL, Reqs, build_model, ceilings, decode_steps, kv_runner,  # noqa: E402
                        llama31_8b_config, mixed_parts, offline, profile_prefill, profile_step)
from services.common.gc_heap import freeze_startup_heap  # noqa: E402
from services.worker.kernels import fp8 as fp8_kernels  # noqa: E402
from services.worker.kernels.fp8 import fp8_linear, quantize_rows  # noqa: E402
from services.worker import attention as ref_attention  # noqa: E402
from services.worker import gpu_exec  # noqa: E402
from services.worker.kernels import attention as kernels_attention  # noqa: E402
from services.worker.kernels import elementwise  # noqa: E402
from services.worker.kernels import pdl  # noqa: E402
from services.worker.models import llama_triton  # noqa: E402
from services.worker.models.fp8 import FP8, Fp8Weight, quantize_layers, quantize_weight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def weight_bytes(model) -> int:
    total = model.embed.numel() * 2 + model.lm_head.numel() * 2
    for lw in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(lw, name)
            total += w.numel() * (1 if isinstance(w, Fp8Weight) else 2) + (w.scale.numel() * 4 if isinstance(
                w, Fp8Weight) else 0)
        total += (lw.input_norm.numel() + lw.post_norm.numel()) * 2
    return total


def proj_params(cfg) -> int:
    """Parameters of the projections a prompt token multiplies through (qkv, o, gate/up, down)."""
    return cfg.num_layers * sum(n * k for n, k in SHAPES.values())


def kernel_checks() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    x = torch.randn(512, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    q, s = quantize_rows(x)
    ref = (x.float() * (1 / s)).clamp(-448, 448).to(FP8)   # kernels/fp8.quantize_act's rule
    out["quantiser_equal_to_torch_cast"] = bool(torch.equal(q.float(), ref.float()))
    errs = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        fw = quantize_weight(w)
        deq = fw.dequantize(torch.float32)
        for m in (1, 7, 64, 256):
            a = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            got = fp8_linear(a, fw).float()
            want = a.float() @ deq.t()
            errs[f"{name}_M{m}"] = float((got - want).norm() / want.norm())
    out["relative_error_vs_dequantised"] = errs
    out["max_relative_error"] = max(errs.values())
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_fp8.json")
    p.add_argument("--offline", default="bf16:fp8,fp8:fp8,fp8:fp8:separate",
                   help="weights:kv[:separate] for the offline 1k/1k runs")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--offline-cap-s", type=float, default=120.0)
    p.add_argument("--kv-gib", type=float, default=64.0)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--weights", default="bf16,fp8")
    p.add_argument("--mixed", action="store_true", help="a mixed prefill/decode step against its parts")
    p.add_argument("--profile", action="store_true", help="per mode: the kernels of an eager decode step at batch "
                   "--profile-batch and of a prefill step of 8 prompts of 1,024 tokens (torch.profiler)")
    p.add_argument("--block-size", type=int, default=BS, help="KV cache block size in tokens (the scheduler's "
                   "--block-size; gpu_attn_decode_probe.py times the attention over 16, 32 and 64)")
    p.add_argument("--profile-batch", type=int, default=256, help="--profile: the eager decode step's rows")
    p.add_argument("--gc-freeze", action="store_true", help="after the warm-up, gc_heap.freeze_startup_heap() "
                   "(freeze, first threshold widened) as every service does")
    p.add_argument("--whole-prompts", action="store_true", help="offline: admit whole prompts only (the loop "
                   "before 2026-12-06), not the scheduler's chunks that fill each step's budget")
    p.add_argument("--gc-census", action="store_true", help="offline: after the loop, with every request still "
                   "held, the collector's oldest generation by type and one full collection timed")
    p.add_argument("--decode-batches", default="1,64,256", help="comma-separated decode step batch sizes")
    p.add_argument("--modes", default="fused,separate",
                   help="FP8-weight forwards to time: fused (the served one), separate, nopdl (fused, its "
                        "kernels launched without programmatic dependent launch: kernels/pdl.py), vrows (fused, "
                        "an fp8 cache's V stored [BS, kvh, d] as before attention.V_TRANSPOSE_FP8), v2d / v3d (fused, "
                        "the transposed V read as a 2D tile or a 3D one: kernels/attention.V_LOAD_2D), slowacc (fused, "
                        "the FP8 GEMMs without fast accumulation: kernels/fp8.FAST_ACCUM), silu_whole / "
                        "silu_chunks (fused, SiLU·mul's FP8 output from the row held whole / walked in chunks of "
                        "2,048: elementwise.SILU_FP8_CONFIG), exact (fused, SiLU with exp and a division and "
                        "activations quantised by division: elementwise.FAST_SILU, fp8.RECIPROCAL_QUANT off), gc700 "
                        "(fused, the offline runs with the garbage collector's default first threshold, not "
                        "gc_heap.GEN0_THRESHOLD), whole (fused, the offline runs admitting whole prompts only), "
                        "heads_first / seqs_first (fused, the attention grid launched with a sequence's KV heads "
                        "side by side or not: kernels/attention.GRID_HEADS_FIRST), float_logits (fused, decode "
                        "graphs widening their logits to float32 as before: gpu_exec.GRAPH_LOGITS_FLOAT)")
    p.add_argument("--kv", default="bf16,fp8", help="comma-separated KV cache dtypes to run")
    p.add_argument("--compile-log", default="", help="write every Triton compile of the process (time, "
                                                    "kernel, specialisation) to this JSON file")
    p.add_argument("--max-seqs", default="256", help="comma-separated: one offline run per value (the most requests in a step)")
    p.add_argument("--token-budget", default="8192", help="offline, comma-separated: the most tokens in a step, "
                   "one run per value and --max-seqs value (the "
                   "runner holds 16,384; vLLM's offline defaults on cards of 70 GiB and more, A100s aside: "
                   "16,384 tokens and 1,024 sequences a step)")
    a = p.parse_args()
    gpu_decode.BS = a.block_size          # read by kv_runner and Reqs at call time
    if a.compile_log:
        import atexit
        from bench.compile_log import CompileLog
        log_all = CompileLog().__enter__()
        atexit.register(lambda: Path(a.compile_log).write_text(json.dumps(log_all.events, indent=0)))
    out = Path(a.out)
    res: dict = {"bench": "gpu_fp8", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def save():
        out.write_text(json.dumps(res, indent=1))
    res["ceilings"] = ceilings()
    bw = res["ceilings"]["copy_bytes_per_s"]
    res["kernel_checks"] = kernel_checks()
    print("checks", res["kernel_checks"], flush=True)
    save()
    cfg = llama31_8b_config()
    gen = torch.Generator().manual_seed(0)
    kv_elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    res["decode"], res["offline"] = [], []
    offline_runs = [tuple(x.split(":")) + (("fused",) if x.count(":") == 1 else ()) for x in a.offline.split(",") if x]
    silu_default = elementwise.SILU_FP8_CONFIG
    v2d_default = kernels_attention.V_LOAD_2D
    hf_default = kernels_attention.GRID_HEADS_FIRST
    for weights in a.weights.split(","):
        model = build_model(cfg, 4096)
        if weights == "fp8":
            t0 = time.perf_counter()
            quantize_layers(model.layers)
            torch.cuda.synchronize()
            res["quantize_s"] = time.perf_counter() - t0
        wbytes = weight_bytes(model)
        res.setdefault("weight_bytes", {})[weights] = wbytes
        for kv_name in a.kv.split(","):
            modes = tuple(a.modes.split(",")) if weights == "fp8" else ("-",)
            wanted = [m for m in modes if (weights, kv_name, m if weights == "fp8" else "fused") in offline_runs]
            if a.skip_decode and not wanted:
                continue
            kv_dtype = None if kv_name == "bf16" else torch.float8_e4m3fn
            for mode in modes:
                # A runner per mode: its hello captures the decode graphs of that forward.
                llama_triton.FUSED_FP8 = mode != "separate"
                pdl.ENABLED = mode != "nopdl"
                fp8_kernels.FAST_ACCUM = mode != "slowacc"
                # "exact": SiLU with exp and a division, activations quantised by division (the math
                # before kernels/elementwise.FAST_SILU and kernels/fp8.RECIPROCAL_QUANT)
                elementwise.FAST_SILU = fp8_kernels.RECIPROCAL_QUANT = mode != "exact"
                ref_attention.V_TRANSPOSE_FP8 = mode != "vrows"
                kernels_attention.V_LOAD_2D = {"v2d": "always", "v3d": "never"}.get(mode, v2d_default)
                kernels_attention.GRID_HEADS_FIRST = mode == "heads_first" or (hf_default and mode != "seqs_first")
                gpu_exec.GRAPH_LOGITS_FLOAT = mode == "float_logits"
                if mode in ("silu_whole", "silu_chunks"):
                    elementwise.SILU_FP8_CONFIG = (16384, 16) if mode == "silu_whole" else (2048, 8, 1)
                runner = kv_runner(model, a.kv_gib, kv_dtype)
                if not a.skip_decode:
                    for b in (int(x) for x in a.decode_batches.split(",")):
                        r = decode_steps(runner, Reqs(runner.num_blocks), b, 1536, 30, gen)
                        floor = wbytes + b * 1536 * kv_elems * (1 if kv_dtype is not None else 2)
                        r.update(weights=weights, kv_cache=kv_name, fp8_mode=mode,
                                 floor_ms_at_measured_bw=floor / bw * 1e3,
                                 floor_ms_at_4_3TBps=floor / COPY_TBPS_NOMINAL * 1e3)
                        r["replay_ratio_to_floor"] = (r["graph_replay_ms"] or r["step_ms_pipelined"]) / r["floor_ms_at_measured_bw"]
                        r["pipelined_ratio_to_floor"] = r["step_ms_pipelined"] / r["floor_ms_at_measured_bw"]
                        res["decode"].append(r)
                        print("decode", r, flush=True)
                        save()
                if a.mixed:
                    r = mixed_parts(runner, Reqs(runner.num_blocks), 256, 1536, 4, 1024, gen)
                    r.update(weights=weights, kv_cache=kv_name, fp8_mode=mode)
                    res.setdefault("mixed", []).append(r)
                    print("mixed", r, flush=True)
                    save()
                if a.profile:
                    r = {"weights": weights, "kv_cache": kv_name, "fp8_mode": mode,
                         "prefill": profile_prefill(runner, Reqs(runner.num_blocks), 1024, gen, prompts=8, top=16)}
                    r["prefill"]["projection_tflops"] = 2 * 8 * 1024 * proj_params(cfg) / r["prefill"]["wall_ms_median"] / 1e9
                    r[f"decode_b{a.profile_batch}_eager"] = profile_step(runner, Reqs(runner.num_blocks),
                                                                         a.profile_batch, 1536, gen, None)
                    res.setdefault("profile", []).append(r)
                    print("profile", json.dumps(r), flush=True)
                    save()
                if mode in wanted:
                    # Warm-up (untimed): every step shape the run will see compiled and allocated once.
                    offline(runner, 16, 8, 1024, 4, 8192, gen, 60.0)
                    thresholds = gc.get_threshold()
                    if a.gc_freeze:   # as every service does after start-up (services/common/gc_heap.py)
                        freeze_startup_heap()
                    if mode == "gc700":   # the collector's default first threshold, as before gc_heap's
                        gc.set_threshold(700, thresholds[1], thresholds[2])
                    for max_seqs, budget in ((int(x), int(y)) for x in a.max_seqs.split(",")
                                             for y in a.token_budget.split(",")):
                        r = offline(runner, a.requests, max_seqs, 1024, 1024, budget, gen, a.offline_cap_s,
                                    gc_census=a.gc_census, chunked=not (a.whole_prompts or mode == "whole"))
                        r.update(weights=weights, kv_cache=kv_name, fp8_mode=mode)
                        res["offline"].append(r)
                        print("offline", r, flush=True)
                        save()
                    gc.set_threshold(*thresholds)
                llama_triton.FUSED_FP8 = pdl.ENABLED = ref_attention.V_TRANSPOSE_FP8 = fp8_kernels.FAST_ACCUM = True
                elementwise.SILU_FP8_CONFIG = silu_default
                kernels_attention.V_LOAD_2D = v2d_default
                kernels_attention.GRID_HEADS_FIRST = hf_default
                gpu_exec.GRAPH_LOGITS_FLOAT = False
                del runner
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    save()
    return 0 if res["kernel_checks"]["quantiser_equal_to_torch_cast"] and res["kernel_checks"]["max_relative_error"] < 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
