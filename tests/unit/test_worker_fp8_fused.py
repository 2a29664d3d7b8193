"""FP8 weights on the GPU path with the quantisation and the scales fused into the kernels around
each GEMM (kernels/fp8.py, elementwise.py, qkv_prep.py; models/llama_triton.py), run on the CPU by
Triton's interpreter (fp32: the interpreter's bf16 arithmetic is wrong, shared FACTS):

- the norm and SiLU·mul quantise their output per token exactly as kernels/fp8.quantize_rows would
  quantise what they used to write (same e4m3 values, same scales);
- every consumer of an unscaled product (qkv prep, the norm, SiLU·mul) gives what it gives on the
  product scaled first;
- the whole forward, fused, equals the forward with one fp8_linear per projection, and stays close
  to the torch reference on the dequantised weights.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is imported
triton = pytest.importorskip("triton")

from services.worker.kernels import elementwise as ke  # noqa: E402
from services.worker.kernels.fp8 import quantize_rows  # noqa: E402
from services.worker.kernels.qkv_prep import qkv_prep_  # noqa: E402
from services.worker.models.llama import rope_cos_sin  # noqa: E402

G = torch.Generator().manual_seed(21)


def scales(t: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(t, 1, generator=G) + 0.05, torch.rand(n, generator=G) * 0.02 + 1e-3


def same_fp8(got, want) -> None:
    assert torch.equal(got[1], want[1]), "per-token scales"
    assert torch.equal(got[0].float(), want[0].float()), "e4m3 values"


def test_norm_quantises_its_output_as_the_quantiser_would():
    x = torch.randn(5, 300, generator=G) * 4
    x[3] = 0    # an all-zero row: scale 1
    w = torch.rand(300, generator=G) + 0.5
    same_fp8(ke.add_rms_norm(x, w, 1e-5, fp8_out=True), quantize_rows(ke.add_rms_norm(x, w, 1e-5)))


def test_norm_scales_an_unscaled_product_adds_the_residual_and_quantises():
    raw = torch.randn(4, 200, generator=G) * 300          # an unscaled FP8 product: large values
    rs, cs = scales(4, 200)
    res_a = torch.randn(4, 200, generator=G)
    res_b = res_a.clone()
    w = torch.rand(200, generator=G) + 0.5
    got = ke.add_rms_norm(raw, w, 1e-5, residual=res_a, in_scales=(rs, cs), fp8_out=True)
    want = quantize_rows(ke.add_rms_norm(raw * rs * cs, w, 1e-5, residual=res_b))
    assert torch.equal(res_a, res_b), "residual += the scaled product"
    same_fp8(got, want)
    plain = ke.add_rms_norm(raw, w, 1e-5, residual=res_a.clone(), in_scales=(rs, cs))
    torch.testing.assert_close(plain, ke.add_rms_norm(raw * rs * cs, w, 1e-5, residual=res_b.clone()),
                               rtol=0, atol=0)


# chunks (two and a ragged end); the row whole; 2 and 4 rows a program (a partial last program)
@pytest.mark.parametrize("config", [(2048, 8), (4096, 16), (2048, 4, 2), (1024, 4, 4)])
def test_silu_mul_scales_its_input_and_quantises_a_whole_row(config):
    raw = torch.randn(3, 2 * 2500, generator=G) * 200
    raw[1, :2500] = 0.0          # a row of zeros (scale 1) beside others in one program
    rs, cs = scales(3, 5000)
    got = ke.silu_mul(raw, in_scales=(rs, cs), fp8_out=True, fp8_config=config)
    same_fp8(got, quantize_rows(ke.silu_mul(raw * rs * cs)))
    torch.testing.assert_close(ke.silu_mul(raw, in_scales=(rs, cs), block=64), ke.silu_mul(raw * rs * cs, block=64),
                               rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_qkv_prep_scales_every_head_before_rope_and_the_cache_write(cache_dtype):
    nh, kvh, d, t = 4, 2, 8, 3
    n = (nh + 2 * kvh) * d
    raw = torch.randn(t, n, generator=G) * 100
    rs, cs = scales(t, n)
    from services.worker.models.config import ModelConfig
    cfg = ModelConfig("llama", 64, nh * d, 64, 1, nh, kvh, d, 1e-5, 10000.0, 64, False)
    cos, sin = rope_cos_sin(cfg, 64, torch.float32, torch.device("cpu"))
    pos = torch.tensor([0, 5, 9])
    slots = torch.tensor([1, 6, -1])       # the last row is padding: not stored
    caches = [torch.zeros(2, 3, 4, kvh, d, dtype=cache_dtype) for _ in range(2)]
    a, b = raw.clone(), raw * rs * cs
    qkv_prep_(a, pos, cos, sin, caches[0], slots, nh, kvh, d, in_scales=(rs, cs))
    qkv_prep_(b, pos, cos, sin, caches[1], slots, nh, kvh, d)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(caches[0].float(), caches[1].float())


def hidden_states(model, ids: list[int], kv=None, start: int = 0) -> torch.Tensor:
    """`ids` at positions start.. of one sequence through forward_triton (the GPU path's forward),
    block size 4, into `kv` (a fresh cache of 4 blocks if None)."""
    from services.worker.models.llama_triton import KernelAttnInputs, forward_triton
    n = len(ids)
    kv = kv if kv is not None else [torch.zeros(model.kv_cache_shape(4, 4), dtype=model.dtype) for _ in model.layers]
    attn = KernelAttnInputs(slot_mapping=torch.arange(start, start + n), block_tables=torch.arange(4, dtype=torch.int32)[None],
                            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                            seq_lens=torch.tensor([start + n], dtype=torch.int32), max_query_len=n)
    return forward_triton(model, torch.tensor(ids), torch.arange(start, start + n), attn, kv)


def test_the_fused_forward_equals_one_fp8_linear_per_projection(tmp_path, monkeypatch):
    from services.worker.attention import SeqSchedule, build_attn_metadata
    from services.worker.models import load_model
    from services.worker.models import llama_triton
    from tests.unit.tiny_llama import make_tiny_llama

    model = load_model(make_tiny_llama(tmp_path, seed=12), quantization="fp8")
    ids = [5, 17, 33, 2, 61, 8, 40]
    fused = hidden_states(model, ids)
    monkeypatch.setattr(llama_triton, "FUSED_FP8", False)
    separate = hidden_states(model, ids)
    torch.testing.assert_close(fused, separate, rtol=1e-4, atol=1e-4)
    # Both quantise the activations per token; the reference runs bf16/fp32 activations on the
    # dequantised weights: close, not equal.
    kv = [torch.zeros(model.kv_cache_shape(2, 4), dtype=model.dtype) for _ in model.layers]
    meta = build_attn_metadata([SeqSchedule([0, 1], 0, len(ids))], 4, model.device)
    want = model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, kv)
    assert not torch.equal(fused, want)
    assert torch.nn.functional.cosine_similarity(fused.flatten(), want.flatten(), dim=0) > 0.99
