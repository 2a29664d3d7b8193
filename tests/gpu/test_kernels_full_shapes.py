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
