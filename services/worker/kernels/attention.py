"""Paged attention over block tables in Triton: one varlen kernel for prefill chunks (which may
start after a cached prefix) and decodes, with grouped-query heads.

KV cache of one layer: `[2, num_blocks, block_size, kvh, d]` (attention.py's layout). The token
at absolute position `pos` of sequence s lives at slot
`block_tables[s, pos // block_size] * block_size + pos % block_size`.

Grid: (num_seqs, q_tiles, kvh). A program takes BLOCK_Q query tokens of one sequence and the
G = nh // kvh query heads that share one KV head, as one [BLOCK_M = BLOCK_Q * G, d] tile (row r is
token r // G, head r % G), so K/V are read once per group, and walks the keys in BLOCK_N tiles with
an online softmax (fp32). Tiles past a sequence's query length exit at once; for decode-only
batches q_tiles is 1, and for CUDA graphs the grid only depends on the padded batch size.

Padding rows of a CUDA-graph bucket have seq_len 0: their loop is empty and they write zeros.

FP8 KV cache (`--kv-cache-dtype fp8`): the cache may be torch.float8_e4m3fn (Triton's fp8e4nv,
Hopper's e4m3). Stores write `x / scale` saturated to +-448 (`quantize_fp8_e4m3`); attention loads
fp8 K/V, widens them for tl.dot (exact: every e4m3 value is an fp16 value) to fp16 for a bf16/fp16
q (fp32 for an fp32 q), and applies the per-tensor scales for free: k_scale inside the softmax
scale, v_scale on the output.

An fp8 cache stores V transposed within each block (services/worker/attention.v_transposed): a
block's V bytes are [kvh, d, BS], a head's 16 keys contiguous per dim, so the p.V dot's B operand
is key-contiguous as the tensor cores want it. With V as [BS, kvh, d] the 16-bit caches use
ldmatrix.trans, but 8-bit values have no such load and Triton gathered V byte by byte from shared
memory (SASS per warp and 64-key tile: 128 LDS.U8 plus ~300 byte packs, 1,200 instructions against
729 transposed; ncu on an H100 at batch 256: 150M instructions vs 89M, DRAM 83% vs 87% of peak,
bench/gpu_fp8_vt_probe.py). V is loaded as [d, blocks, BS] (each block's 16 keys one 16-byte
vector; a gathered block id in a flat key offset makes Triton fall back to byte loads) and masked
per block: a partly filled block's tail is read too, which p = 0 cancels as long as those bytes
are finite, so an fp8 cache must start zero-filled (the runner's is; every store saturates).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from services.worker.attention import v_transposed
from services.worker.kernels.pdl import launch_args, wait_prior

_LOG2E = 1.4426950408889634
# A transposed V (v_transposed) loaded as a 2D [d, keys] tile with contiguity hints instead of a 3D
# [d, blocks, BS] one: "prefill" (launches with prompt rows), "always" or "never". Compiled for
# sm_90a, the 2D load keeps the 16-byte loads, uses the 2D shared buffer the rows layout uses and one
# block-table load a tile instead of two. H100 (bench/gpu_fp8_vt_probe.py ->
# bench/results/gpu_fp8_vt_probe_2d_h100.json): prefill 4 x 1,024 0.177 ms against 0.224 (the 3D
# tile has ~90x the shared-load bank conflicts there, ncu), but decode slower (b64 0.099 vs 0.085 ms;
# the whole 8B model's b256 step 16.1 vs 14.4 ms); so 2D for prefill launches only.
V_LOAD_2D = "prefill"
# Grid order: True launches (kv head, tiles, seq), so a sequence's heads run side by side and read
# neighbouring bytes of the same cache blocks; False launches (seq, tiles, kv head), so programs
# running together read one KV head of many sequences. H100, fp8 cache, context 1,536
# (bench/gpu_attn_decode_probe.py -> bench/results/gpu_attn_decode_probe_h100.json): b512 0.5454 vs
# 0.5504 ms, b256 0.2833 vs 0.2853; a bare gather read of the same bytes takes 0.523-0.535 at b512.
GRID_HEADS_FIRST = True
FP8_E4M3_MAX = 448.0
# KV cache dtypes the kernels store and read; fp8 is e4m3fn (no inf, max 448), as in vLLM.
KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


# On a GPU the e4m3 rounding is the hardware's conversion (cvt.rn.satfinite: nearest-even, one
# instruction for two values); Triton's CPU interpreter (the CI tests) rounds fp32 -> fp8 wrongly
# when the mantissa carries into the exponent (125.3 became 64), so there it is done by hand. The
# two give the same bytes (tests/gpu/test_kernels_full_shapes.py checks the GPU's against torch's
# cast over every e4m3 tie, subnormals and saturation). H100, prefill of 8,192 tokens: the q/k/v
# prep with an fp8 cache took 286 us against 89 with a bf16 one, the hand rounding most of it.
_HW_FP8_CVT = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def quantize_fp8_e4m3(x, scale, UNIT_SCALE: tl.constexpr = False):
    """`x / scale` (fp32, IEEE division) saturated to +-448 and rounded to nearest-even onto the
    e4m3 grid: e4m3 values on a GPU, the same values as fp32 under the interpreter; either way
    `.to(fp8 cache dtype)` after it is exact. UNIT_SCALE: the scale is known to be 1 (no division:
    an IEEE division is a reciprocal, fix-ups and a slow-path call per value in the SASS).

    Every KV store into an fp8 cache goes through this one rule (`attention.quantize_kv` is the torch
    twin, bit for bit). Saturating first makes out-of-range values clamp instead of becoming NaN.
    """
    y = x.to(tl.float32) if UNIT_SCALE else tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)                      # FP8_E4M3_MAX
    if _HW_FP8_CVT:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        sign = bits ^ mag                               # keeps -0.0 as torch's cast does
        a = mag.to(tl.float32, bitcast=True)
        # Normal e4m3 range (>= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even; the carry
        # may run into the exponent (that is the rounding up to the next power of two).
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -0x100000
        # Subnormal range (< 2^-6): multiples of 2^-9; adding 2^23 to a * 2^9 rounds it to an integer.
        sub = (((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125).to(tl.int32, bitcast=True)
        r = tl.where(a < 0.015625, sub, normal)
        q = (r | sign).to(tl.float32, bitcast=True)
    return q


@triton.jit
def _paged_attn_kernel(
    q_ptr, o_ptr, part_o_ptr, part_ml_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_ptr, seq_lens_ptr, seq_ids_ptr,
    sm_scale_log2, v_scale,               # softmax scale * log2(e) * k_scale; the fp8 cache's V scale
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,      # cache strides: block, slot in block, kv head (d is 1)
    stride_bt,                            # block table row stride
    window,                               # sliding window (0: off)
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP16_DOTS: tl.constexpr,              # fp8 cache, 16-bit q: both dots in fp16 (see paged_attention)
    HAS_SEQ_IDS: tl.constexpr,            # grid axis 0 walks seq_ids (a subset of the batch's sequences)
    USE_PDL: tl.constexpr = False,        # kernels/pdl.py
    V_T: tl.constexpr = False,            # V stored per block as [kvh, d, BLOCK_SIZE] (fp8 caches)
    V_2D: tl.constexpr = False,           # with V_T: V_LOAD_2D's load (see there)
    DECODE: tl.constexpr = False,         # every sequence of the launch has one query token
    HAS_WINDOW: tl.constexpr = False,     # window > 0 (a branch on it inside the key loop costs)
    HEADS_FIRST: tl.constexpr = False,    # grid (kvh, tiles, seqs) instead of (seqs, tiles, kvh)
):
    wait_prior(USE_PDL)
    if HEADS_FIRST:
        seq = tl.program_id(2)
        kvh = tl.program_id(0)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(2)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + seq).to(tl.int32)
    tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)          # context length incl. this step's tokens
    first_q_pos = ctx - q_len                  # absolute position of the chunk's first token

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // G           # token index within the chunk
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
    q_pos = first_q_pos + tok                  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM

    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP16_DOTS:
        # bf16 -> fp16 is exact from 6e-5 to 65504 (fp16 has more mantissa bits); clamp the rest
        # so an outlier cannot become inf.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys this tile can see: [lo, hi). Causal: up to its last query's position.
    last_q = tl.minimum(first_q_pos + (tile + 1) * BLOCK_Q, ctx)
    # A tile past the chunk's end (grids are sized by the longest chunk) runs no iteration.
    hi = tl.where(tile * BLOCK_Q < q_len, last_q, 0)
    lo = first_q_pos * 0
    if window > 0:
        lo = tl.maximum(first_q_pos + tile * BLOCK_Q - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        # Split-KV (flash-decoding): this program takes one BLOCK_N-aligned share of the keys.
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(lo + chunk, hi)
    # Key tiles ending at or below open_hi need no mask: below hi, and (prefill) at or before the
    # tile's first query position, so causal for all its rows. Only the diagonal tiles and the
    # last one build it.
    open_hi = hi if DECODE else tl.minimum(first_q_pos + tile * BLOCK_Q + 1, hi)
    cols = tl.arange(0, BLOCK_N)
    NBLK: tl.constexpr = BLOCK_N // BLOCK_SIZE if V_T and not V_2D else 1
    VT_BS: tl.constexpr = BLOCK_SIZE if V_T and not V_2D else 1      # (any block size without V_T)
    jb = tl.arange(0, NBLK)
    ii = tl.arange(0, VT_BS)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + cols                                            # [BLOCK_N]
        k_ok = k_pos < hi
        kb_ok = (k_pos // BLOCK_SIZE) * BLOCK_SIZE < hi                 # the key's block is in range
        # (masked per block, so a block's tail keys carry its id: V_2D's runs stay contiguous)
        blk = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=kb_ok, other=0)
        slot_off = blk.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_off = slot_off[:, None] + dims[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        # An fp8 cache is widened to q's dtype here (a no-op for a cache of q's dtype).
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)     # [BLOCK_N, D]
        if V_T and V_2D:
            # [D, BLOCK_N] with hints for what Triton cannot see through the gathered block ids:
            # each block's BLOCK_SIZE keys are one contiguous run starting at a multiple of
            # BLOCK_SIZE (a contiguous cache), so they load as vectors. Masked per block.
            v_off = ((blk.to(tl.int64) * stride_cb + kvh * (HEAD_DIM * BLOCK_SIZE) + k_pos % BLOCK_SIZE)[None, :]
                     + dims[:, None] * BLOCK_SIZE)
            v_off = tl.max_contiguous(tl.multiple_of(v_off, [1, BLOCK_SIZE]), [1, BLOCK_SIZE])
            vt = tl.load(v_cache_ptr + v_off, mask=d_ok[:, None] & kb_ok[None, :], other=0.0).to(q.dtype)
        elif V_T:
            # [D, blocks, BS] -> [D, BLOCK_N]: whole blocks (start is BLOCK_N-aligned), masked per
            # block; keys past hi in the last block are finite bytes whose p is 0.
            bpos = start + jb * BLOCK_SIZE
            b_ok = bpos < hi
            vblk = tl.load(block_tables_ptr + seq * stride_bt + bpos // BLOCK_SIZE, mask=b_ok, other=0)
            v_off = ((vblk.to(tl.int64) * stride_cb + kvh * (HEAD_DIM * BLOCK_SIZE))[None, :, None]
                     + dims[:, None, None] * BLOCK_SIZE + ii[None, None, :])
            vt = tl.load(v_cache_ptr + v_off, mask=d_ok[:, None, None] & b_ok[None, :, None], other=0.0)
            vt = tl.reshape(vt, [BLOCK_D, BLOCK_N]).to(q.dtype)                   # [D, BLOCK_N]
        else:
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale_log2       # [BLOCK_M, BLOCK_N]
        if HAS_WINDOW or start + BLOCK_N > open_hi:    # else every row may see every key of the tile
            if DECODE:
                # one query at ctx - 1: every key below hi (<= ctx) is causal
                allowed = tl.broadcast_to(k_ok[None, :], [BLOCK_M, BLOCK_N])
            else:
                allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if HAS_WINDOW:
                allowed &= k_pos[None, :] > q_pos[:, None] - window
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing allowed yet keep m = -inf: use 0 as their shift so no NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_T:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), tl.trans(vt)).to(tl.float32)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v).to(tl.float32)
        m_i = m_new
    if NUM_SPLITS > 1:
        # Unnormalised partials [T, NUM_SPLITS, nh, d] and (m, l) [T, NUM_SPLITS, nh, 2] (fp32).
        prow = ((q_start + tok) * NUM_SPLITS + split) * NUM_HEADS + head
        st_ok = row_ok[:, None] & d_ok[None, :]
        # The combine is linear in the partials: V's scale can go in here (x 1.0 is exact).
        tl.store(part_o_ptr + prow[:, None] * HEAD_DIM + dims[None, :], acc * v_scale, mask=st_ok)
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.maximum(l_i, 1e-30)[:, None] * v_scale
        o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_ml_ptr, o_ptr, stride_ot, stride_oh,
                           NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_prior(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    prow = (t * NUM_SPLITS + sp) * NUM_HEADS + h                                 # [S]
    m = tl.load(part_ml_ptr + prow * 2)
    l = tl.load(part_ml_ptr + prow * 2 + 1)
    acc = tl.load(part_o_ptr + prow[:, None] * HEAD_DIM + dims[None, :], mask=d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)                                                       # empty split: 0
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l * w, 0), 1e-30)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + dims, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """KV splits for a decode batch: enough programs to cover the SMs twice (power of 2, <= 32).
    On the H200 (bench/results/gpu_attn_sweep.json, ctx 1536): batch 1 -> 32 splits 0.023 ms/layer
    (16 splits: 0.086); batch >= 64 -> 1 split."""
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    return min(32, triton.next_power_of_2(want)) if want > 1 else 1


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                    scale: float, out: torch.Tensor | None = None, sliding_window: int | None = None,
                    block_m: int | None = None, block_n: int | None = None,
                    num_splits: int = 1, num_warps: int | None = None,
                    num_stages: int | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, nh, d] (row stride free, head dim contiguous); kv_cache: [2, NB, BS, kvh, d];
    block_tables: [S, max_blocks] int32; query_start_loc: [S + 1] int32 (cumulative query
    lengths); seq_lens: [S] int32 (context incl. this step). Returns o [T, nh, d].

    The K/V of this step's tokens must already be in the cache (write them first).
    `max_query_len` only sizes the grid: an upper bound is fine (CUDA graphs pass 1).
    `num_splits` > 1 (decode batches only: max_query_len 1) splits each sequence's keys over that
    many programs and combines them in a second kernel, so small batches still fill the GPU.
    An fp8 cache holds K / k_scale and V / v_scale (write_kv); 1.0 leaves other caches as they were.
    `seq_ids` (int tensor): attend for these sequences of the batch only (the others' rows of `out`
    are left as they are), e.g. a mixed step's decodes with decode tiles and its prompt chunks with
    prefill tiles, in two launches; max_query_len is then the largest among them.
    With an fp8 cache and a bf16/fp16 q both dots run in fp16: e4m3 -> fp16 is one cvt per two
    values on Hopper, while e4m3 -> bf16 goes through fp32 and made the kernel slower than a bf16
    cache (H200, batch 256 x 1,536 tokens, Llama-3-8B heads: bf16 cache 382 us/layer, fp8 via bf16
    515, fp8 via fp16 264 at 2 warps / 6 stages; reading the fp8 bytes alone takes 212).
    """
    t, nh, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    g = nh // kvh
    num_seqs = block_tables.shape[0] if seq_ids is None else seq_ids.shape[0]
    if out is None:
        out = torch.empty(t, nh, d, dtype=q.dtype, device=q.device)
    if block_m is None:
        # Decode: one token x G heads fits in a 16-row tile (tl.dot's minimum).
        block_m = max(16, triton.next_power_of_2(g)) if max_query_len == 1 else max(64, triton.next_power_of_2(g))
    block_q = max(1, block_m // g)
    # Defaults from the H200 sweep (bench/gpu_attn_sweep.py): prefill 64x32 tiles, 4 warps, 3 stages
    # (1024-token prompt: 0.062 ms/layer vs 0.119 for 64x64/8 warps); decode 16x64, 4 warps, 3 stages.
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    decode = max_query_len == 1
    # fp8 tiles from the same kind of sweep over an fp8 cache: decode 2 warps and, when each program
    # walks a long key range (<= 2 splits), 6 stages (half the bytes per tile: more tiles in flight
    # keep HBM busy; short split loops only pay the deeper prologue); prefill 64x64 tiles, 2 stages.
    block_n = block_n or (64 if decode or fp8 else 32)
    v_t = v_t_block_size(kv_cache) > 0
    if v_t:
        block_n = max(block_n, bs)      # a tile takes whole blocks of the transposed V
    if num_warps is None:
        num_warps = 2 if fp8 and decode else 4
    if num_stages is None:
        num_stages = (6 if num_splits <= 2 else 3) if fp8 and decode else 2 if fp8 else 3
    q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    kc, vc = kv_cache[0], kv_cache[1]
    assert q.stride(2) == 1 and kc.stride(3) == 1 and out.stride(2) == 1
    _check_cache_dtype(kv_cache)
    if num_splits > 1:
        if max_query_len != 1:
            raise ValueError("split-KV attention is for decode batches (max_query_len 1)")
        part_o = torch.empty(t, num_splits, nh, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, num_splits, nh, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    heads_first = GRID_HEADS_FIRST and num_seqs <= 65535          # a grid's z extent is at most 65,535
    grid = (kvh, q_tiles * num_splits, num_seqs) if heads_first else (num_seqs, q_tiles * num_splits, kvh)
    _paged_attn_kernel[grid](
        q, out, part_o, part_ml, kc, vc, block_tables, query_start_loc, seq_lens,
        seq_ids if seq_ids is not None else seq_lens,
        scale * _LOG2E * k_scale, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        sliding_window or 0,
        NUM_HEADS=nh, NUM_SPLITS=num_splits, G=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=bs,
        FP16_DOTS=fp8 and q.dtype in (torch.bfloat16, torch.float16), HAS_SEQ_IDS=seq_ids is not None,
        V_T=v_t, V_2D=v_t and _v_load_2d(decode), DECODE=decode, HAS_WINDOW=bool(sliding_window),
        HEADS_FIRST=heads_first,
        num_warps=num_warps, num_stages=num_stages, **launch_args(q),
    )
    if num_splits > 1:
        _combine_splits_kernel[(t, nh)](part_o, part_ml, out, out.stride(0), out.stride(1),
                                        NUM_HEADS=nh, NUM_SPLITS=num_splits, HEAD_DIM=d,
                                        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4,
                                        **launch_args(part_o))
    return out


def _v_load_2d(decode: bool) -> bool:
    if V_LOAD_2D not in ("prefill", "always", "never"):
        raise ValueError(f"V_LOAD_2D is {V_LOAD_2D!r}: prefill, always or never")
    return V_LOAD_2D == "always" or (V_LOAD_2D == "prefill" and not decode)


def v_t_block_size(kv_cache: torch.Tensor) -> int:
    """The block size where V is stored transposed per block (v_transposed), else 0; the offsets
    of a transposed V assume a contiguous cache."""
    if not v_transposed(kv_cache):
        return 0
    if not kv_cache.is_contiguous():
        raise ValueError("an fp8 cache with V transposed per block must be contiguous")
    return kv_cache.shape[2]


def _check_cache_dtype(kv_cache: torch.Tensor) -> None:
    # torch.float8_e4m3fn reaches Triton as fp8e4nv (the e4m3 of sm_89+), the type this file assumes.
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {kv_cache.dtype} is not one of {KV_CACHE_DTYPES}")


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_kt, stride_vt, stride_cslot, k_scale, v_scale,
                     KVD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KVD: tl.constexpr,
                     FP8: tl.constexpr, USE_PDL: tl.constexpr = False, V_T_BS: tl.constexpr = 0,
                     UNIT_SCALES: tl.constexpr = False):
    # V_T_BS > 0: V stored per block as [kvh, d, V_T_BS]; column c = head * d + dim of a token in
    # slot s then lives at (s // BS) * BS * KVD + c * BS + s % BS.
    wait_prior(USE_PDL)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_KVD)
    slot = tl.load(slot_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (cols < KVD)[None, :]        # slot -1: a padding row
    k = tl.load(k_ptr + toks[:, None] * stride_kt + cols[None, :], mask=ok)
    v = tl.load(v_ptr + toks[:, None] * stride_vt + cols[None, :], mask=ok)
    dst = slot[:, None] * stride_cslot + cols[None, :]
    if V_T_BS:
        v_dst = ((slot // V_T_BS) * (V_T_BS * stride_cslot) + slot % V_T_BS)[:, None] + cols[None, :] * V_T_BS
    else:
        v_dst = dst
    if FP8:
        k = quantize_fp8_e4m3(k, k_scale, UNIT_SCALES)
        v = quantize_fp8_e4m3(v, v_scale, UNIT_SCALES)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             block_t: int = 4, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, kvh, d] (views of the fused qkv are fine: only the row stride may differ);
    slot_mapping: [T] int (negative: skip). Scatters into kv_cache [2, NB, BS, kvh, d]; an fp8
    cache stores k / k_scale and v / v_scale (quantize_fp8_e4m3); the scales matter only there,
    and V transposed per block where v_transposed says so."""
    t, kvh, d = k.shape
    if t == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    assert k.stride(1) == d and v.stride(1) == d and k.stride(2) == 1 and v.stride(2) == 1
    _check_cache_dtype(kv_cache)
    kvd = kvh * d
    grid = (triton.cdiv(t, block_t),)
    _write_kv_kernel[grid](k, v, kc, vc, slot_mapping, t, k.stride(0), v.stride(0), kc.stride(1),
                           float(k_scale), float(v_scale),
                           KVD=kvd, BLOCK_T=block_t, BLOCK_KVD=triton.next_power_of_2(kvd),
                           FP8=kv_cache.dtype == torch.float8_e4m3fn,
                           V_T_BS=v_t_block_size(kv_cache), UNIT_SCALES=k_scale == 1.0 and v_scale == 1.0,
                           num_warps=4, **launch_args(k))
