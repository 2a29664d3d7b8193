"""The fused q/k-norm + RoPE + KV-write kernel (kernels/qkv_prep.py) equals the torch reference
(rms_norm, apply_rope, index_copy_ into the cache), run on the CPU by Triton's interpreter
(fp32 / fp16: the interpreter's bf16 arithmetic is wrong, see shared FACTS)."""
from __future__ import annotations

import os

import pytest
import torch

# Must be set before the kernels are decorated (on import).
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from services.worker import attention as ref  # noqa: E402
from services.worker.kernels import elementwise as ke  # noqa: E402
from services.worker.kernels.attention import write_kv  # noqa: E402
from services.worker.kernels.qkv_prep import qkv_prep_  # noqa: E402
from services.worker.models.config import ModelConfig, RopeScaling  # noqa: E402
from services.worker.models.llama import apply_rope, rms_norm, rope_cos_sin  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
EPS = 1e-6
LLAMA3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def tables(nh, kvh, d, rope=RopeScaling(), max_len=512):
    cfg = ModelConfig("llama", 100, nh * d, 64, 1, nh, kvh, d, 1e-5, 500000.0, max_len, False,
                      rope_scaling=rope)
    return rope_cos_sin(cfg, max_len, torch.float32, torch.device("cpu"))


def reference(qkv, pos, cos, sin, cache, slots, nh, kvh, d, q_norm=None, k_norm=None):
    """The unfused path on a copy: q/k norm as the torch ops (rounded to the storage dtype),
    RoPE in fp32, K/V written by the reference write_kv (index_copy_) for the non-padding rows.
    Returns (q, k) in fp32 (unrounded RoPE) and the expected cache (not fp8 caches)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.reshape(t, nh, d), k.reshape(t, kvh, d), v.reshape(t, kvh, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, EPS), rms_norm(k, k_norm, EPS)
    c, s = cos[pos][:, None], sin[pos][:, None]
    q, k = apply_rope(q.float(), c, s), apply_rope(k.float(), c, s)
    want_cache = None
    if cache.dtype != torch.float8_e4m3fn:
        want_cache = cache.clone()
        keep = slots >= 0
        ref.write_kv(want_cache, k[keep].to(qkv.dtype).to(cache.dtype), v[keep].to(cache.dtype),
                     slots[keep])
    return q, k, want_cache


def run_case(nh, kvh, d, dtype, pos, slots, norm=False, rope=RopeScaling(), pad_cols=0,
             heads_per_program=None, seed=0, cache_dtype=None, k_scale=1.0, v_scale=1.0):
    torch.manual_seed(seed)
    t = pos.shape[0]
    nb, bs = 8, 4
    cos, sin = tables(nh, kvh, d, rope)
    width = (nh + 2 * kvh) * d
    # a row stride wider than the heads (pad_cols): the kernel must not touch the extra columns
    buf = torch.randn(t, width + pad_cols, dtype=dtype)
    qkv = buf[:, :width]
    q_norm = (torch.rand(d, dtype=dtype) + 0.5) if norm else None
    k_norm = (torch.rand(d, dtype=dtype) + 0.5) if norm else None
    cache = torch.randn(2, nb, bs, kvh, d).to(cache_dtype or dtype)
    want_q, want_k, want_cache = reference(qkv.clone(), pos, cos, sin, cache, slots, nh, kvh, d,
                                           q_norm, k_norm)
    v_before = qkv[:, (nh + kvh) * d:].clone()
    extra_before = buf[:, width:].clone()
    out = qkv_prep_(qkv, pos, cos, sin, cache, slots, nh, kvh, d, q_norm=q_norm, k_norm=k_norm,
                    eps=EPS, k_scale=k_scale, v_scale=v_scale, heads_per_program=heads_per_program)
    assert out.data_ptr() == qkv.data_ptr()
    oq, ok, ov = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
    assert rel_err(oq.reshape(t, nh, d), want_q) < TOL[dtype]
    assert rel_err(ok.reshape(t, kvh, d), want_k) < TOL[dtype]
    assert torch.equal(ov, v_before), "v must be left alone in qkv"
    assert torch.equal(buf[:, width:], extra_before), "columns past the heads must be untouched"
    # The cache holds exactly what the reference write_kv stores for the k left in qkv and the v,
    # at the non-padding slots (fp8: quantized); the rest (padding rows included) is untouched.
    keep = slots >= 0
    exact = cache.clone()
    ref.write_kv(exact, ok.reshape(t, kvh, d)[keep], v_before.reshape(t, kvh, d)[keep], slots[keep],
                 k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), exact.view(torch.uint8))
    if want_cache is not None:
        assert rel_err(cache, want_cache) < TOL[dtype]
    return qkv, cache


# GQA 1, 3 and 8; the Llama ones with plain and Llama 3 scaled RoPE
@pytest.mark.parametrize("nh,kvh", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("rope", [RopeScaling(), LLAMA3], ids=["plain", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_llama_rope_and_kv_write_match_reference(nh, kvh, rope, dtype):
    pos = torch.tensor([0, 1, 5, 100, 101, 300, 511])  # ragged: decodes and a chunk, any order
    slots = torch.tensor([3, 0, 31, 17, 18, 9, 24])
    run_case(nh, kvh, 32, dtype, pos, slots, rope=rope, seed=nh + kvh)


@pytest.mark.parametrize("nh,kvh", [(6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qwen3_qk_norm_then_rope_matches_reference(nh, kvh, dtype):
    pos = torch.tensor([7, 8, 9, 10, 42])
    slots = torch.tensor([12, 13, 14, 15, 2])
    run_case(nh, kvh, 16, dtype, pos, slots, norm=True, seed=nh)


def test_padding_rows_leave_the_cache_alone_and_heads_may_straddle_programs():
    """slot -1 rows (CUDA-graph padding) write nothing; their q/k still rotate harmlessly.
    2 heads per program: groups straddle the q/k and k/v boundaries (6 + 2 + 2 heads); a row
    stride wider than the heads."""
    pos = torch.tensor([3, 0, 64, 0])
    slots = torch.tensor([5, -1, 30, -1])
    run_case(6, 2, 16, torch.float32, pos, slots, norm=True, pad_cols=24, heads_per_program=2)
    run_case(6, 2, 16, torch.float32, pos, slots, rope=LLAMA3, heads_per_program=4)


def test_all_padding_and_empty_batches_write_nothing():
    nh, kvh, d = 4, 2, 16
    cos, sin = tables(nh, kvh, d)
    cache = torch.randn(2, 4, 4, kvh, d)
    before = cache.clone()
    qkv = torch.randn(2, (nh + 2 * kvh) * d)
    qkv_prep_(qkv, torch.tensor([1, 2]), cos, sin, cache, torch.tensor([-1, -1]), nh, kvh, d)
    assert torch.equal(cache, before)
    empty = torch.empty(0, (nh + 2 * kvh) * d)
    qkv_prep_(empty, torch.empty(0, dtype=torch.long), cos, sin, cache,
              torch.empty(0, dtype=torch.long), nh, kvh, d)
    assert torch.equal(cache, before)


def test_same_result_as_the_three_kernels_it_replaces():
    """Bit-identical to torch q/k norm + rope_ + write_kv (fp16, the order of roundings)."""
    nh, kvh, d, t = 6, 2, 32, 6
    torch.manual_seed(4)
    cos, sin = tables(nh, kvh, d, LLAMA3)
    qkv = torch.randn(t, (nh + 2 * kvh) * d, dtype=torch.float16)
    qn, kn = torch.rand(d, dtype=torch.float16) + 0.5, torch.rand(d, dtype=torch.float16) + 0.5
    pos = torch.tensor([0, 9, 10, 11, 200, 3])
    slots = torch.tensor([0, 1, 2, 3, -1, 20])
    cache = torch.randn(2, 6, 4, kvh, d, dtype=torch.float16)
    a, ca = qkv.clone(), cache.clone()
    qk = a[:, :(nh + kvh) * d].view(t, nh + kvh, d)
    qk[:, :nh] = rms_norm(qk[:, :nh], qn, EPS)
    qk[:, nh:] = rms_norm(qk[:, nh:], kn, EPS)
    ke.rope_(a, pos, cos, sin, nh + kvh, d)
    write_kv(ca, a[:, nh * d:(nh + kvh) * d].view(t, kvh, d), a[:, (nh + kvh) * d:].view(t, kvh, d),
             slots)
    b, cb = qkv.clone(), cache.clone()
    qkv_prep_(b, pos, cos, sin, cb, slots, nh, kvh, d, q_norm=qn, k_norm=kn, eps=EPS)
    assert torch.equal(a, b) and torch.equal(ca, cb)


def test_bad_arguments_are_refused():
    nh, kvh, d = 4, 2, 16
    cos, sin = tables(nh, kvh, d)
    qkv = torch.randn(2, (nh + 2 * kvh) * d)
    pos, slots = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="go together"):
        qkv_prep_(qkv, pos, cos, sin, torch.zeros(2, 2, 4, kvh, d), slots, nh, kvh, d,
                  q_norm=torch.ones(d))
    with pytest.raises(ValueError, match="kv_cache shape"):
        qkv_prep_(qkv, pos, cos, sin, torch.zeros(2, 2, 4, kvh + 1, d), slots, nh, kvh, d)
    with pytest.raises(ValueError, match="columns"):
        qkv_prep_(qkv[:, :-1], pos, cos, sin, torch.zeros(2, 2, 4, kvh, d), slots, nh, kvh, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_stores_the_quantized_rotated_k_and_v(dtype):
    """An e4m3fn cache gets x / scale saturated to ±448, rounded to even (the reference write_kv's
    rule, bit for bit), for the normed and rotated k and for v; small scales make some values
    saturate; padding rows write nothing."""
    pos = torch.tensor([0, 3, 77, 78, 200, 5])
    slots = torch.tensor([4, -1, 30, 31, 0, 11])
    _, cache = run_case(6, 2, 16, dtype, pos, slots, norm=True, rope=LLAMA3, seed=9,
                        cache_dtype=torch.float8_e4m3fn, k_scale=0.004, v_scale=0.3)
    assert (cache.float().abs() == 448).any(), "the case must exercise saturation"
