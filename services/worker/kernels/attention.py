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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attn_kernel(
    q_ptr, o_ptr, part_o_ptr, part_ml_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_ptr, seq_lens_ptr,
    sm_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,      # cache strides: block, slot in block, kv head (d is 1)
    stride_bt,                            # block table row stride
    window,                               # sliding window (0: off)
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kvh = tl.program_id(2)
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
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + cols                                            # [BLOCK_N]
        k_ok = k_pos < hi
        blk = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot_off = blk.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_off = slot_off[:, None] + dims[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)     # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale_log2       # [BLOCK_M, BLOCK_N]
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if window > 0:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing allowed yet keep m = -inf: use 0 as their shift so no NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    if NUM_SPLITS > 1:
        # Unnormalised partials [T, NUM_SPLITS, nh, d] and (m, l) [T, NUM_SPLITS, nh, 2] (fp32).
        prow = ((q_start + tok) * NUM_SPLITS + split) * NUM_HEADS + head
        st_ok = row_ok[:, None] & d_ok[None, :]
        tl.store(part_o_ptr + prow[:, None] * HEAD_DIM + dims[None, :], acc, mask=st_ok)
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_ml_ptr, o_ptr, stride_ot, stride_oh,
                           NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
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
                    num_stages: int = 3) -> torch.Tensor:
    """q: [T, nh, d] (row stride free, head dim contiguous); kv_cache: [2, NB, BS, kvh, d];
    block_tables: [S, max_blocks] int32; query_start_loc: [S + 1] int32 (cumulative query
    lengths); seq_lens: [S] int32 (context incl. this step). Returns o [T, nh, d].

    The K/V of this step's tokens must already be in the cache (write them first).
    `max_query_len` only sizes the grid: an upper bound is fine (CUDA graphs pass 1).
    `num_splits` > 1 (decode batches only: max_query_len 1) splits each sequence's keys over that
    many programs and combines them in a second kernel, so small batches still fill the GPU.
    """
    t, nh, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    g = nh // kvh
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty(t, nh, d, dtype=q.dtype, device=q.device)
    if block_m is None:
        # Decode: one token x G heads fits in a 16-row tile (tl.dot's minimum).
        block_m = max(16, triton.next_power_of_2(g)) if max_query_len == 1 else max(64, triton.next_power_of_2(g))
    block_q = max(1, block_m // g)
    # Defaults from the H200 sweep (bench/gpu_attn_sweep.py): prefill 64x32 tiles, 4 warps, 3 stages
    # (1024-token prompt: 0.062 ms/layer vs 0.119 for 64x64/8 warps); decode 16x64, 4 warps, 3 stages.
    block_n = block_n or (64 if max_query_len == 1 else 32)
    q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    kc, vc = kv_cache[0], kv_cache[1]
    assert q.stride(2) == 1 and kc.stride(3) == 1 and out.stride(2) == 1
    if num_splits > 1:
        if max_query_len != 1:
            raise ValueError("split-KV attention is for decode batches (max_query_len 1)")
        part_o = torch.empty(t, num_splits, nh, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, num_splits, nh, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    grid = (num_seqs, q_tiles * num_splits, kvh)
    _paged_attn_kernel[grid](
        q, out, part_o, part_ml, kc, vc, block_tables, query_start_loc, seq_lens,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        sliding_window or 0,
        NUM_HEADS=nh, NUM_SPLITS=num_splits, G=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=bs,
        num_warps=num_warps or 4, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(t, nh)](part_o, part_ml, out, out.stride(0), out.stride(1),
                                        NUM_HEADS=nh, NUM_SPLITS=num_splits, HEAD_DIM=d,
                                        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4)
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_kt, stride_vt, stride_cslot,
                     KVD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KVD: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_KVD)
    slot = tl.load(slot_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (cols < KVD)[None, :]        # slot -1: a padding row
    k = tl.load(k_ptr + toks[:, None] * stride_kt + cols[None, :], mask=ok)
    v = tl.load(v_ptr + toks[:, None] * stride_vt + cols[None, :], mask=ok)
    dst = slot[:, None] * stride_cslot + cols[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             block_t: int = 4) -> None:
    """k, v: [T, kvh, d] (views of the fused qkv are fine: only the row stride may differ);
    slot_mapping: [T] int (negative: skip). Scatters into kv_cache [2, NB, BS, kvh, d]."""
    t, kvh, d = k.shape
    if t == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    assert k.stride(1) == d and v.stride(1) == d and k.stride(2) == 1 and v.stride(2) == 1
    kvd = kvh * d
    grid = (triton.cdiv(t, block_t),)
    _write_kv_kernel[grid](k, v, kc, vc, slot_mapping, t, k.stride(0), v.stride(0), kc.stride(1),
                           KVD=kvd, BLOCK_T=block_t, BLOCK_KVD=triton.next_power_of_2(kvd),
                           num_warps=4)
