"""Every Triton kernel of the GPU path equals the torch reference, run on the CPU by Triton's
interpreter (fp32 / fp16: the interpreter's bf16 arithmetic is wrong, see shared FACTS).

Shapes are small and blocks large: the interpreter costs ~10 ms per program per loop iteration.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

# Must be set before the kernels are decorated (on import), and only for this module's kernels.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from services.worker import attention as ref  # noqa: E402
from services.worker.kernels import attention as ka  # noqa: E402
from services.worker.kernels import elementwise as ke  # noqa: E402
from services.worker.models.config import ModelConfig, RopeScaling  # noqa: E402
from services.worker.models.llama import apply_rope, rms_norm, rope_cos_sin  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def make_batch(rng: random.Random, specs, block_size: int, num_blocks: int):
    """specs: (num_computed, num_scheduled) per sequence, decodes first. Random, disjoint
    block tables. Returns SeqSchedules + the Triton metadata tensors."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for computed, sched in specs:
        n = -(-(computed + sched) // block_size) + rng.randrange(2)  # sometimes a spare block
        seqs.append(ref.SeqSchedule([free.pop() for _ in range(n)], computed, sched))
    max_blocks = max(len(s.block_ids) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_ids)] = torch.tensor(s.block_ids)
    qsl = torch.tensor([0] + [s.num_scheduled_tokens for s in seqs]).cumsum(0).to(torch.int32)
    lens = torch.tensor([s.context_len for s in seqs], dtype=torch.int32)
    return seqs, tables, qsl, lens


# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8
@pytest.mark.parametrize("nh,kvh", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_reference_on_ragged_batch(nh, kvh, dtype):
    rng = random.Random(nh * 10 + kvh)
    torch.manual_seed(nh)
    d, bs, nb = 32, 16, 24
    # two decodes (one at a partial block, one at a block edge), a fresh prompt, a prompt chunk
    # after a cached prefix, a chunk ending mid-block
    specs = [(36, 1), (15, 1), (0, 21), (32, 9), (7, 30)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    t = sum(s for _, s in specs)
    cache = torch.randn(2, nb, bs, kvh, d, dtype=dtype)
    q = torch.randn(t, nh, d, dtype=dtype)
    k = torch.randn(t, kvh, d, dtype=dtype)
    v = torch.randn(t, kvh, d, dtype=dtype)
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"))
    want_cache = cache.clone()
    want = ref.paged_attention(q.float(), k.float(), v.float(), want_cache_f := want_cache.float(), meta, d ** -0.5)
    ka.write_kv(cache, k, v, meta.slot_mapping)
    assert torch.equal(cache, want_cache_f.to(dtype)), "KV write differs from index_copy_"
    out = ka.paged_attention(q, cache, tables, qsl, lens, max(s for _, s in specs), d ** -0.5)
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("kv_dtype,heads_first", [(torch.float32, False), (torch.float8_e4m3fn, False),
                                                  (torch.float8_e4m3fn, True)])
def test_a_mixed_step_in_two_launches_by_sequence_equals_one_launch(kv_dtype, heads_first, monkeypatch):
    """seq_ids: decodes (interleaved with prompt chunks, as the runner orders new requests before
    cached ones) with decode tiles and KV splits, the chunks with prefill tiles, into one output;
    the same with the grid launched heads first (GRID_HEADS_FIRST)."""
    monkeypatch.setattr(ka, "GRID_HEADS_FIRST", heads_first)
    rng = random.Random(7)
    torch.manual_seed(7)
    nh, kvh, d, bs, nb = 6, 2, 32, 16, 40
    specs = [(0, 21), (36, 1), (32, 9), (15, 1), (50, 1)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    t = sum(s for _, s in specs)
    cache = torch.randn(2, nb, bs, kvh, d).to(kv_dtype)
    q = torch.randn(t, nh, d)
    whole = ka.paged_attention(q, cache, tables, qsl, lens, 21, d ** -0.5)
    out = torch.full_like(whole, float("nan"))
    ka.paged_attention(q, cache, tables, qsl, lens, 1, d ** -0.5, out=out, num_splits=4,
                       seq_ids=torch.tensor([1, 3, 4]))
    ka.paged_attention(q, cache, tables, qsl, lens, 21, d ** -0.5, out=out, seq_ids=torch.tensor([0, 2]))
    assert not out.isnan().any(), "every row written by one of the two launches"
    assert rel_err(out, whole) < 1e-5


def test_paged_attention_prefill_tiles_skip_the_mask_only_below_their_first_query():
    """Small tiles (8 tokens x 2 heads, 16 keys): each query tile of a long chunk after a cached
    prefix sees some key tiles whole (no mask built) and some on its diagonal; a fresh prompt and
    a decode before them."""
    rng = random.Random(11)
    nh, kvh, d, bs, nb = 4, 2, 16, 8, 40
    specs = [(23, 1), (40, 50), (0, 45)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    t = sum(s for _, s in specs)
    cache = torch.randn(2, nb, bs, kvh, d)
    q, k, v = torch.randn(t, nh, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"))
    want = ref.paged_attention(q, k, v, cache.clone(), meta, d ** -0.5)
    ka.write_kv(cache, k, v, meta.slot_mapping)
    out = ka.paged_attention(q, cache, tables, qsl, lens, 50, d ** -0.5, block_m=16, block_n=16)
    assert rel_err(out, want) < 2e-5


def test_paged_attention_decode_only_with_small_blocks_and_padding_rows():
    """block_size 4 (a tile spans many blocks) and a CUDA-graph padding row (seq_len 0)."""
    rng = random.Random(3)
    nh, kvh, d, bs, nb = 4, 1, 16, 4, 40
    specs = [(17, 1), (3, 1), (40, 1)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    cache = torch.randn(2, nb, bs, kvh, d)
    q, k, v = torch.randn(3, nh, d), torch.randn(3, kvh, d), torch.randn(3, kvh, d)
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"))
    want = ref.paged_attention(q, k, v, cache.clone(), meta, 0.3)
    ka.write_kv(cache, k, v, meta.slot_mapping)
    # a padding row: query 4 with context 0 and slot -1 (skipped by the KV write)
    qp = torch.cat([q, torch.randn(1, nh, d)])
    tables_p = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    qsl_p = torch.arange(5, dtype=torch.int32)
    lens_p = torch.cat([lens, torch.zeros(1, dtype=torch.int32)])
    before = cache.clone()
    ka.write_kv(cache, torch.randn(1, kvh, d), torch.randn(1, kvh, d), torch.tensor([-1]))
    assert torch.equal(cache, before)
    out = ka.paged_attention(qp, cache, tables_p, qsl_p, lens_p, 1, 0.3)
    assert rel_err(out[:3], want) < 2e-5
    assert torch.isfinite(out[3]).all()
    # split-KV (flash-decoding) gives the same result, padding row included
    split = ka.paged_attention(qp, cache, tables_p, qsl_p, lens_p, 1, 0.3, block_n=16, num_splits=4)
    assert rel_err(split[:3], want) < 2e-5
    assert torch.isfinite(split[3]).all()


def test_paged_attention_sliding_window_matches_reference():
    rng = random.Random(5)
    nh, kvh, d, bs, nb, window = 4, 2, 16, 8, 30, 12
    specs = [(29, 1), (0, 26), (16, 10)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    cache = torch.randn(2, nb, bs, kvh, d)
    t = sum(s for _, s in specs)
    q, k, v = torch.randn(t, nh, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"), sliding_window=window)
    want = ref.paged_attention(q, k, v, cache.clone(), meta, d ** -0.5)
    ka.write_kv(cache, k, v, meta.slot_mapping)
    out = ka.paged_attention(q, cache, tables, qsl, lens, 26, d ** -0.5, sliding_window=window,
                             block_n=16)
    assert rel_err(out, want) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_matches_reference_and_updates_residual(dtype):
    torch.manual_seed(0)
    x, res, w = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype), torch.rand(96, dtype=dtype) + 0.5
    want_res = res + x
    want = rms_norm(want_res, w, 1e-5)
    res_k = res.clone()
    out = ke.add_rms_norm(x, w, 1e-5, residual=res_k)
    assert torch.equal(res_k, want_res)
    assert rel_err(out, want) < TOL[dtype]
    assert rel_err(ke.add_rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("rope", [RopeScaling(), RopeScaling("llama3", 8.0, 1.0, 4.0, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_on_fused_qkv_matches_reference_including_llama3_scaling(rope, dtype):
    nh, kvh, d = 6, 2, 32
    cfg = ModelConfig("llama", 100, nh * d, 64, 1, nh, kvh, d, 1e-5, 500000.0, 512, False,
                      rope_scaling=rope)
    cos, sin = rope_cos_sin(cfg, 512, torch.float32, torch.device("cpu"))
    torch.manual_seed(1)
    t = 7
    qkv = torch.randn(t, (nh + 2 * kvh) * d, dtype=dtype)
    pos = torch.tensor([0, 1, 5, 100, 101, 300, 511])
    q, k, v = qkv.float().split([nh * d, kvh * d, kvh * d], dim=-1)
    c, s = cos[pos][:, None], sin[pos][:, None]
    want_q = apply_rope(q.reshape(t, nh, d), c, s)
    want_k = apply_rope(k.reshape(t, kvh, d), c, s)
    out = ke.rope_(qkv.clone(), pos, cos, sin, nh + kvh, d)
    oq, ok, ov = out.split([nh * d, kvh * d, kvh * d], dim=-1)
    assert rel_err(oq.reshape(t, nh, d), want_q) < TOL[dtype]
    assert rel_err(ok.reshape(t, kvh, d), want_k) < TOL[dtype]
    assert torch.equal(ov, qkv[:, (nh + kvh) * d:]), "v must be left alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_reference(dtype):
    torch.manual_seed(2)
    x = torch.randn(3, 2 * 80, dtype=dtype)
    gate, up = x.float().chunk(2, dim=-1)
    assert rel_err(ke.silu_mul(x, block=64), torch.nn.functional.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernel_forward_in_the_runner_gives_the_reference_greedy_tokens(tmp_path, family):
    """The GPU executor's path (persistent buffers + Triton forward), run on the CPU through the
    interpreter, samples the same greedy tokens as the torch reference with chunked prefill,
    mixed prefill/decode steps and split-KV decodes (Qwen3: q/k norm too)."""
    from services.worker.models import load_model
    from tests.unit.tiny_llama import make_tiny_family, make_tiny_llama

    model = load_model(make_tiny_llama(tmp_path, seed=3) if family == "llama"
                       else make_tiny_family(tmp_path, "qwen3", seed=3, head_dim=16))
    ref, kernels = reference_and_kernel_runs(model)
    assert ref == kernels


def reference_and_kernel_runs(model, kv_cache_dtype=None):
    """Greedy outputs of two prompts (chunked prefill, mixed steps, split-KV decodes) through the
    torch reference forward, then through the GPU executor's Triton path under the interpreter."""
    from services.worker.gpu_exec import GpuExecutor
    from services.worker.runner import ModelRunner
    from services.worker.wire import ProtoRunner
    from tests.worker_driver import MiniScheduler

    # The short prompt decodes while the long one is still chunked: mixed steps (two attention launches).
    prompts = [[8, 8, 30], [5, 9, 11, 40, 7, 3, 22, 61, 17, 4, 13, 50]]
    outs = []
    for kernels in (False, True):
        runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=16, block_size=4,
                             kv_cache_dtype=kv_cache_dtype)
        runner.hello(4)
        assert runner.kv_caches[0].dtype == (kv_cache_dtype or model.dtype)
        if kernels:
            runner.gpu = GpuExecutor(model, runner.kv_caches, 4, max_num_tokens=64, max_num_seqs=4,
                                     graph_sizes=None)
        sched = MiniScheduler(ProtoRunner(runner).execute, 4, 16, budget=6)
        for i, p in enumerate(prompts):
            sched.add(f"r{i}", p, 5)
        outs.append(sched.run())
    return outs


# ---- FP8 KV cache (--kv-cache-dtype fp8) ------------------------------------------------------
# The interpreter loads/stores fp8 (as bytes) and widens fp8 -> fp16/fp32 exactly; its fp32 -> fp8
# cast mis-rounds when the mantissa carries into the exponent, which the kernels' own rounding
# (quantize_fp8_e4m3) avoids: these tests hold the GPU's code path to the torch reference bit for bit.
FP8 = torch.float8_e4m3fn


def wide_values(n: int, kvh: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """K/V-like values over fp8's whole range: normals, subnormals (< 2^-6), ties, beyond 448."""
    mag = torch.logspace(-11, 10, n * kvh * d, base=2.0)[torch.randperm(n * kvh * d, generator=gen)]
    x = (mag * torch.randn(n * kvh * d, generator=gen).sign()).view(n, kvh, d)
    x[0, 0, :8] = torch.tensor([448.0, 464.0, 500.0, -1e4, 0.0, -0.0, 2.0 ** -10, 1.5 * 2.0 ** -9])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
def test_write_kv_into_fp8_cache_equals_reference_quantization_bit_for_bit(dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(7)
    t, kvh, d, bs, nb = 9, 2, 32, 4, 8
    k = wide_values(t, kvh, d, gen).to(dtype)
    v = (wide_values(t, kvh, d, gen) * 3).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[4] = -1                                                  # a padding row: skipped
    cache = torch.randn(2, nb, bs, kvh, d, generator=gen).to(FP8)
    want = cache.clone()
    keep = slots >= 0
    ref.write_kv(want, k[keep], v[keep], slots[keep], k_scale, v_scale)
    ka.write_kv(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    # saturation, not NaN: 464, 500 and -1e4 (over scale 1) land on +-448
    assert not want.float().isnan().any()
    if k_scale == 1.0:
        assert want[0].view(-1, kvh, d)[slots[0], 0, :4].float().tolist() == [448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("bs,load_2d,heads_first", [(8, "never", False), (8, "always", False), (12, "prefill", False),
                                                   (8, "never", True)])
def test_fp8_cache_keeps_v_transposed_per_block_where_the_block_size_allows(bs, load_2d, heads_first, monkeypatch):
    """An fp8 cache whose block size is a power of two stores V per block as [kvh, d, BS] (keys
    contiguous, kernels/attention.py); another block size keeps [BS, kvh, d]. The Triton store and
    the torch reference put the same bytes there, and attention over either layout, with stale
    finite bytes in the blocks' unused tails, equals the reference; so does the grid launched
    heads first (GRID_HEADS_FIRST)."""
    monkeypatch.setattr(ka, "GRID_HEADS_FIRST", heads_first)
    rng = random.Random(bs)
    gen = torch.Generator().manual_seed(bs)
    nh, kvh, d, nb = 4, 2, 16, 20
    specs = [(2 * bs + 3, 1), (5, 1), (0, bs + 5), (bs, 3)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    t = sum(s for _, s in specs)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (nh, kvh, kvh))
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"))
    stale = (torch.randn(2, nb, bs, kvh, d, generator=gen) * 100).to(FP8)   # finite, up to +-448
    cache, want_cache = stale.clone(), stale.clone()
    want = ref.paged_attention(q, k, v, want_cache, meta, 0.25)
    ka.write_kv(cache, k, v, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    slots = meta.slot_mapping
    blk, off = slots // bs, slots % bs
    raw_v = cache[1].view(torch.uint8)
    assert ref.v_transposed(cache) == (bs == 8)
    got = raw_v.view(nb, kvh, d, bs)[blk, :, :, off] if bs == 8 else raw_v[blk, off]
    assert torch.equal(got, ref.quantize_kv(v, FP8).view(torch.uint8))
    monkeypatch.setattr(ka, "V_LOAD_2D", load_2d)     # the transposed V read as a 2D tile or a 3D one
    out = ka.paged_attention(q, cache, tables, qsl, lens, max(s for _, s in specs), 0.25)
    assert rel_err(out, want) < 2e-5
    if bs == 8:   # split-KV decodes too (ragged contexts, padding row of context 0)
        dec = [i for i, (_, s) in enumerate(specs) if s == 1]
        dq = torch.cat([q[qsl[i]:qsl[i] + 1] for i in dec])
        d_out = ka.paged_attention(dq, cache, tables[dec], torch.arange(len(dec) + 1, dtype=torch.int32),
                                   lens[dec], 1, 0.25, num_splits=4, block_n=16)
        assert rel_err(d_out, torch.cat([want[qsl[i]:qsl[i] + 1] for i in dec])) < 2e-5


def test_the_kv_tier_layout_names_the_transposed_v_so_only_like_engines_share_blocks():
    from services.worker.kv_tiers import layout
    assert layout(FP8, 16) == "L2BHD-VT"
    assert layout(FP8, 12) == layout(torch.bfloat16, 16) == layout(torch.float32, 64) == "L2BHD"


@pytest.mark.parametrize("nh,kvh", [(6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_over_fp8_cache_matches_reference_on_ragged_batch(nh, kvh, dtype):
    """Prefill chunks (fresh and after a cached prefix) and decodes over an fp8 cache, with
    non-trivial scales: the kernel equals the fp32 torch reference over the same fp8 bytes."""
    rng = random.Random(nh + kvh)
    gen = torch.Generator().manual_seed(nh)
    d, bs, nb, k_scale, v_scale = 32, 16, 24, 0.5, 2.0
    specs = [(36, 1), (15, 1), (0, 21), (32, 9), (7, 30)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    t = sum(s for _, s in specs)
    cache = (torch.randn(2, nb, bs, kvh, d, generator=gen) * 2).to(FP8)
    q = torch.randn(t, nh, d, generator=gen).to(dtype)
    k = (torch.randn(t, kvh, d, generator=gen) * 2).to(dtype)
    v = torch.randn(t, kvh, d, generator=gen).to(dtype)
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"))
    want_cache = cache.clone()
    want = ref.paged_attention(q.float(), k.float(), v.float(), want_cache, meta, d ** -0.5,
                               k_scale, v_scale)
    ka.write_kv(cache, k, v, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    out = ka.paged_attention(q, cache, tables, qsl, lens, max(s for _, s in specs), d ** -0.5,
                             k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    assert rel_err(out, want) < TOL[dtype]
    # the scales really act: the same bytes read at scale 1 give another answer
    plain = ref.paged_attention(q.float(), k.float(), v.float(), want_cache.clone(), meta, d ** -0.5)
    assert rel_err(plain, want) > 0.1


def test_paged_attention_fp8_decode_with_splits_matches_reference():
    """Split-KV decodes (the combine kernel) over an fp8 cache, a CUDA-graph padding row included."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    nh, kvh, d, bs, nb, k_scale, v_scale = 4, 2, 16, 4, 40, 1.0, 0.75
    specs = [(17, 1), (3, 1), (40, 1)]
    seqs, tables, qsl, lens = make_batch(rng, specs, bs, nb)
    cache = torch.randn(2, nb, bs, kvh, d, generator=gen).to(FP8)
    q, k, v = (torch.randn(3, h, d, generator=gen) for h in (nh, kvh, kvh))
    meta = ref.build_attn_metadata(seqs, bs, torch.device("cpu"))
    want_cache = cache.clone()
    want = ref.paged_attention(q, k, v, want_cache, meta, 0.3, k_scale, v_scale)
    ka.write_kv(cache, k, v, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    qp = torch.cat([q, torch.randn(1, nh, d, generator=gen)])
    tables_p = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    lens_p = torch.cat([lens, torch.zeros(1, dtype=torch.int32)])
    for splits in (1, 4):
        out = ka.paged_attention(qp, cache, tables_p, torch.arange(5, dtype=torch.int32), lens_p, 1, 0.3,
                                 block_n=16, num_splits=splits, k_scale=k_scale, v_scale=v_scale)
        assert rel_err(out[:3], want) < 2e-5, splits
        assert torch.isfinite(out[3]).all()


def test_kernels_refuse_an_unsupported_cache_dtype():
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="KV cache dtype"):
        ka.write_kv(cache, torch.randn(1, 1, 16), torch.randn(1, 1, 16), torch.tensor([0]))


def test_kernel_forward_with_fp8_cache_gives_the_reference_fp8_greedy_tokens(tmp_path):
    """The GPU executor's path over an fp8 cache (fused q/k prep + KV store, paged attention with
    split-KV decodes) samples the torch reference's tokens over an fp8 cache: both store the same
    bytes (quantize_fp8_e4m3 == attention.quantize_kv) and attend in fp32."""
    from services.worker.models import load_model
    from tests.unit.tiny_llama import make_tiny_llama

    model = load_model(make_tiny_llama(tmp_path, seed=4))
    ref, kernels = reference_and_kernel_runs(model, FP8)
    assert ref == kernels


# ---- batch-1 GEMV (kernels/gemv.py) -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(40, 96, False), (33, 80, True)])
def test_gemv_matches_linear_including_ragged_edges(dtype, n, k, bias):
    """Row counts and K not multiples of the tiles (masked edges), with and without bias."""
    from services.worker.kernels.gemv import gemv
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemv(x, w, b, config=(16, 32, 4, 2))
    assert got.shape == (1, n) and got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]
    # The first K tile apart (as under PDL on a GPU), with K under, at and over one tile.
    from services.worker.kernels.gemv import gemv_kernel
    for bk in (128, 64, 32):
        peeled = torch.empty_like(got)
        gemv_kernel[(triton.cdiv(n, 16),)](x, w, w, b if b is not None else w, peeled, n, k, w.stride(0),
                                           HAS_SCALE=False, HAS_BIAS=b is not None, BLOCK_N=16, BLOCK_K=bk,
                                           PEEL_FIRST=True)
        assert rel_err(peeled, want) < TOL[dtype], bk
