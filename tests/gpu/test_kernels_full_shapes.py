"""Triton kernels at full model shapes in bf16 on the GPU vs the torch reference in fp32 on the
bf16-rounded inputs: relative error within bf16 tolerance (METHOD: 1e-3..1e-2)."""
from __future__ import annotations

import random

import pytest
import torch

from services.worker import attention as ref
from services.worker.models.config import ModelConfig, RopeScaling
from services.worker.models.llama import apply_rope, rms_norm, rope_cos_sin

BF16_TOL = 1e-2
DEV = torch.device("cuda")


def rel_err(out, want):
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def batch(specs, bs, nb, seed):
    rng = random.Random(seed)
    free = list(range(nb))
    rng.shuffle(free)
    seqs = [ref.SeqSchedule([free.pop() for _ in range(-(-(c + s) // bs))], c, s) for c, s in specs]
    mb = max(len(s.block_ids) for s in seqs)
    tables = torch.zeros(len(seqs), mb, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_ids)] = torch.tensor(s.block_ids)
    qsl = torch.tensor([0] + [s for _, s in specs]).cumsum(0).to(torch.int32)
    lens = torch.tensor([c + s for c, s in specs], dtype=torch.int32)
    return seqs, tables.to(DEV), qsl.to(DEV), lens.to(DEV)


# Llama-3-8B (G 4), Llama-2-7B-like MHA (G 1), Qwen2.5-7B (G 7), G 8
@pytest.mark.parametrize("nh,kvh,d", [(32, 8, 128), (32, 32, 128), (28, 4, 128), (64, 8, 128)])
@pytest.mark.parametrize("mixed", [True, False])
def test_paged_attention_full_shapes_bf16(nh, kvh, d, mixed):
    from services.worker.kernels.attention import decode_splits, paged_attention, write_kv
    bs, nb = 16, 1200
    specs = [(1535, 1), (99, 1), (16, 1), (2047, 1)] + ([(0, 1024), (700, 512), (33, 95)] if mixed else [])
    seqs, tables, qsl, lens = batch(specs, bs, nb, nh + kvh)
    t = sum(s for _, s in specs)
    g = torch.Generator(device=DEV).manual_seed(nh * kvh)
    cache = torch.randn(2, nb, bs, kvh, d, device=DEV, generator=g, dtype=torch.bfloat16)
    q = torch.randn(t, nh, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k = torch.randn(t, kvh, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v = torch.randn(t, kvh, d, device=DEV, generator=g, dtype=torch.bfloat16)
    meta = ref.build_attn_metadata(seqs, bs, DEV)
    cache32 = cache.float()
    want = ref.paged_attention(q.float(), k.float(), v.float(), cache32, meta, d ** -0.5)
    write_kv(cache, k, v, meta.slot_mapping)
    assert torch.equal(cache.float(), cache32)
    splits = 1 if mixed else decode_splits(len(specs), kvh)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_attention(q, cache, tables, qsl, lens, max(s for _, s in specs), d ** -0.5, out=out,
                    num_splits=splits)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < BF16_TOL


FP8 = torch.float8_e4m3fn


def fp8_roundtrip(x, scale):
    """What an fp8 cache gives back for x: the reference quantization, dequantized to fp32."""
    return ref.quantize_kv(x, FP8, scale).float() * scale


def stored_bytes(cache: torch.Tensor, i: int) -> torch.Tensor:
    """K (i = 0) or V (1) of an fp8 cache as [slots, kvh, d] bytes, whatever V's storage order."""
    raw = cache.view(torch.uint8)
    plane = raw[0] if i == 0 else ref.v_blocks(raw, ref.v_transposed(cache))
    return plane.reshape(-1, *cache.shape[3:])


# Llama-3-8B shape; scales 1.0 (what --kv-cache-dtype fp8 uses) and non-trivial ones
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("mixed", [True, False])
def test_paged_attention_full_shapes_fp8_cache(mixed, k_scale, v_scale):
    """bf16 q over an fp8 (e4m3fn) cache: 2,048-token decodes (split-KV when decode-only), a
    1,024-token prefill and a chunk after a prefix, vs fp32 torch over the same dequantized cache."""
    from services.worker.kernels.attention import decode_splits, paged_attention, write_kv
    nh, kvh, d, bs, nb = 32, 8, 128, 16, 1200
    specs = [(1535, 1), (99, 1), (16, 1), (2047, 1)] + ([(0, 1024), (700, 512), (33, 95)] if mixed else [])
    seqs, tables, qsl, lens = batch(specs, bs, nb, 3)
    t = sum(s for _, s in specs)
    g = torch.Generator(device=DEV).manual_seed(17)
    cache = (torch.randn(2, nb, bs, kvh, d, device=DEV, generator=g) * 3).to(FP8)
    q = torch.randn(t, nh, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k = (torch.randn(t, kvh, d, device=DEV, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(t, kvh, d, device=DEV, generator=g, dtype=torch.bfloat16)
    meta = ref.build_attn_metadata(seqs, bs, DEV)
    deq = torch.stack([cache[0].float() * k_scale, ref.v_blocks(cache).float() * v_scale])
    want = ref.paged_attention(q.float(), fp8_roundtrip(k.float(), k_scale), fp8_roundtrip(v.float(), v_scale),
                               deq, meta, d ** -0.5)
    write_kv(cache, k, v, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    slots = meta.slot_mapping
    for i, (x, sc) in enumerate(((k, k_scale), (v, v_scale))):
        assert torch.equal(stored_bytes(cache, i)[slots], ref.quantize_kv(x, FP8, sc).view(torch.uint8))
    splits = 1 if mixed else decode_splits(len(specs), kvh)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, cache, tables, qsl, lens, max(s for _, s in specs), d ** -0.5, out=out,
                    num_splits=splits, k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < BF16_TOL


def test_write_kv_fp8_saturates_and_matches_torch_bit_for_bit():
    """Values over fp8's whole range (subnormals, ties, beyond 448) at a full decode-batch shape:
    the kernel's rounding + the GPU's cvt give torch's cast of the clamped value, never NaN."""
    from services.worker.kernels.attention import write_kv
    t, kvh, d, bs, nb = 512, 8, 128, 16, 64
    g = torch.Generator(device=DEV).manual_seed(5)
    mag = torch.exp2(torch.rand(2, t, kvh, d, device=DEV, generator=g) * 22 - 12)
    kv = (mag * torch.randn(2, t, kvh, d, device=DEV, generator=g).sign()).to(torch.bfloat16)
    cache = torch.zeros(2, nb, bs, kvh, d, device=DEV, dtype=FP8)
    slots = torch.randperm(nb * bs, device=DEV, generator=g)[:t]
    write_kv(cache, kv[0], kv[1], slots)
    for i in range(2):
        assert torch.equal(stored_bytes(cache, i)[slots], ref.quantize_kv(kv[i], FP8).view(torch.uint8))
    assert not cache.float().isnan().any()


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp8_hardware_rounding_matches_torch_on_every_tie_and_its_neighbours(scale):
    """On a GPU the e4m3 rounding is the conversion instruction (kernels/attention._HW_FP8_CVT):
    every e4m3 value, every midpoint between neighbours (the ties), one fp32 ulp either side of
    each, subnormals, -0.0 and values past 448, through write_kv from fp32 K/V: torch's bytes."""
    from services.worker.kernels.attention import write_kv
    grid = torch.arange(0, 256, dtype=torch.uint8, device=DEV).view(FP8).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()                 # 0 .. 448, sorted
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                      torch.nextafter(mids, torch.zeros_like(mids)),
                      torch.tensor([448.5, 464.0, 480.0, 1e6, 3e38, 2.0 ** -10, 2.0 ** -12], device=DEV)])
    vals = torch.cat([vals, -vals, torch.tensor([-0.0], device=DEV)]) * scale
    kvh, d, bs = 8, 128, 16
    t = -(-vals.numel() // (kvh * d))
    flat = torch.zeros(t * kvh * d, device=DEV)
    flat[:vals.numel()] = vals
    k = flat.view(t, kvh, d)
    v = k.flip(0).contiguous()
    nb = -(-t // bs) + 2
    cache = torch.zeros(2, nb, bs, kvh, d, device=DEV, dtype=FP8)
    slots = torch.randperm(nb * bs, device=DEV)[:t]
    write_kv(cache, k, v, slots, k_scale=scale, v_scale=scale)
    for i, x in enumerate((k, v)):
        assert torch.equal(stored_bytes(cache, i)[slots], ref.quantize_kv(x, FP8, scale).view(torch.uint8))


def test_add_rms_norm_full_shape_bf16():
    from services.worker.kernels.elementwise import add_rms_norm
    x, res = torch.randn(2, 777, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(4096, device=DEV, dtype=torch.bfloat16) + 0.5
    want_res = (res.float() + x.float())
    want = rms_norm(want_res, w.float(), 1e-5)
    res_k = res.clone()
    out = add_rms_norm(x, w, 1e-5, residual=res_k)
    assert rel_err(res_k, want_res) < BF16_TOL and rel_err(out, want) < BF16_TOL


def test_rope_llama3_full_shape_bf16():
    from services.worker.kernels.elementwise import rope_
    nh, kvh, d = 32, 8, 128
    cfg = ModelConfig("llama", 128256, 4096, 14336, 32, nh, kvh, d, 1e-5, 500000.0, 131072, False,
                      rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    cos, sin = rope_cos_sin(cfg, 16384, torch.float32, DEV)
    qkv = torch.randn(1000, (nh + 2 * kvh) * d, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 16384, (1000,), device=DEV)
    q, k, _ = qkv.float().split([nh * d, kvh * d, kvh * d], dim=-1)
    c, s = cos[pos][:, None], sin[pos][:, None]
    out = rope_(qkv.clone(), pos, cos, sin, nh + kvh, d)
    oq, ok, _ = out.split([nh * d, kvh * d, kvh * d], dim=-1)
    assert rel_err(oq.reshape(1000, nh, d), apply_rope(q.reshape(1000, nh, d), c, s)) < BF16_TOL
    assert rel_err(ok.reshape(1000, kvh, d), apply_rope(k.reshape(1000, kvh, d), c, s)) < BF16_TOL


def test_silu_mul_full_shape_bf16():
    from services.worker.kernels.elementwise import silu_mul
    x = torch.randn(300, 2 * 14336, device=DEV, dtype=torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    assert rel_err(silu_mul(x), torch.nn.functional.silu(gate) * up) < BF16_TOL


def _qkv_prep_case(t, norm, cache_dtype=torch.bfloat16, k_scale=1.0, v_scale=1.0):
    """Llama-3-8B (Llama 3 RoPE scaling) or Qwen3-8B-like (q/k norm, theta 1e6) attention shapes,
    T tokens at random positions and distinct slots, every 7th row a padding row (slot -1).
    Returns the kernel's outputs and the fp32 reference on the same bf16 inputs."""
    from services.worker.kernels.qkv_prep import qkv_prep_
    nh, kvh, d, bs, nb, max_len = 32, 8, 128, 16, 256, 16384
    rope = RopeScaling() if norm else RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    cfg = ModelConfig("qwen3" if norm else "llama", 151936, 4096, 12288, 36, nh, kvh, d, 1e-6,
                      1000000.0 if norm else 500000.0, 40960, False, qk_norm=norm,
                      rope_scaling=rope)
    cos, sin = rope_cos_sin(cfg, max_len, torch.float32, DEV)
    g = torch.Generator(device=DEV).manual_seed(t * 2 + norm)
    qkv = torch.randn(t, (nh + 2 * kvh) * d, device=DEV, generator=g, dtype=torch.bfloat16)
    pos = torch.randint(0, max_len, (t,), device=DEV, generator=g)
    slots = torch.randperm(nb * bs, device=DEV, generator=g)[:t]
    slots[1::7] = -1
    qn = kn = None
    if norm:
        qn = torch.rand(d, device=DEV, generator=g).to(torch.bfloat16) + 0.5
        kn = torch.rand(d, device=DEV, generator=g).to(torch.bfloat16) + 0.5
    cache = torch.randn(2, nb, bs, kvh, d, device=DEV, generator=g).to(cache_dtype)
    before = cache.clone()
    q, k, v = qkv.float().split([nh * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.reshape(t, nh, d), k.reshape(t, kvh, d), v.reshape(t, kvh, d)
    if norm:
        q, k = rms_norm(q, qn.float(), 1e-6), rms_norm(k, kn.float(), 1e-6)
    c, s = cos[pos][:, None], sin[pos][:, None]
    want_q, want_k = apply_rope(q, c, s), apply_rope(k, c, s)
    qkv_prep_(qkv, pos, cos, sin, cache, slots, nh, kvh, d, q_norm=qn, k_norm=kn, eps=1e-6,
              k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    oq, ok, ov = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
    return (oq.reshape(t, nh, d), ok.reshape(t, kvh, d), ov.reshape(t, kvh, d), want_q, want_k, v,
            cache, before, slots)


@pytest.mark.parametrize("t", [1, 1024])
@pytest.mark.parametrize("norm", [False, True], ids=["llama3_8b", "qwen3_8b"])
def test_qkv_prep_full_shapes_bf16(t, norm):
    oq, ok, ov, want_q, want_k, v, cache, before, slots = _qkv_prep_case(t, norm)
    assert rel_err(oq, want_q) < BF16_TOL and rel_err(ok, want_k) < BF16_TOL
    assert torch.equal(ov.float(), v), "v must be left alone in qkv"
    keep = slots >= 0
    flat, flat_before = cache.view(2, -1, 8, 128), before.view(2, -1, 8, 128)
    assert torch.equal(flat[0, slots[keep]], ok[keep]), "the cache holds the k left in qkv"
    assert torch.equal(flat[1, slots[keep]].float(), v[keep])
    assert rel_err(flat[0, slots[keep]], want_k[keep]) < BF16_TOL
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched]), "padding rows write nothing"


def test_qkv_prep_fp8_cache_full_shape():
    """e4m3fn cache: clamp(x / scale, ±448) of the bf16 k left in qkv and of v. Small scales make
    ~2% of the values saturate."""
    fp8 = torch.float8_e4m3fn
    k_scale, v_scale = 0.005, 0.0075
    oq, ok, ov, want_q, want_k, v, cache, before, slots = _qkv_prep_case(
        1024, True, cache_dtype=fp8, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(oq, want_q) < BF16_TOL and rel_err(ok, want_k) < BF16_TOL
    keep = slots >= 0
    # compared as fp32 (exact for e4m3fn): indexing float8 tensors is not supported everywhere
    # (V of an fp8 cache is stored transposed per block: attention.v_blocks gives it in slot order)
    flat, flat_before = (torch.stack([c[0].float(), ref.v_blocks(c).float()]).view(2, -1, 8, 128)
                         for c in (cache, before))
    want_k8 = (ok[keep].float() / k_scale).clamp(-448, 448).to(fp8)
    want_v8 = (v[keep] / v_scale).clamp(-448, 448).to(fp8)
    got_k, got_v = flat[0, slots[keep]], flat[1, slots[keep]]
    assert (got_k.abs() == 448).float().mean() > 0.005, "the case must exercise saturation"
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    # Same inputs and rule: equal but for a rare 1-ulp flip (torch may divide by a scalar through
    # its reciprocal; the kernel's division is correctly rounded).
    assert (got_k != want_k8.float()).float().mean() < 1e-5
    assert (got_v != want_v8.float()).float().mean() < 1e-5
    # Dequantised, within fp8 (3 mantissa bits) of the fp32 reference where nothing saturated.
    inside = want_k[keep].abs() < 440 * k_scale
    assert rel_err(got_k[inside] * k_scale, want_k[keep][inside]) < 0.05
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


# Llama-3-8B o, down and lm_head at batch 1 (the shapes the batch-1 GEMV serves)
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (128256, 4096), (6144, 4096)])
def test_gemv_full_shapes_bf16(n, k):
    from services.worker.kernels.gemv import gemv
    g = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=g)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert rel_err(gemv(x, w, b), want) < BF16_TOL
