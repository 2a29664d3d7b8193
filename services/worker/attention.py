"""Reference paged attention in plain torch (the oracle a Triton kernel will be checked against).

KV cache of one layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V).
Token at absolute position `pos` of a request lives at
`slot = block_table[pos // block_size] * block_size + pos % block_size`.

A step is a flattened varlen batch of T query tokens. The runner orders sequences so the
ones with a single query token (decodes, and 1-token prompt chunks) come first: they are
attended in one batched SDPA call over gathered, padded K/V. Longer chunks (prefill, possibly
starting after a cached prefix) are attended one sequence at a time, causal within the chunk.
Metadata is built once per step and shared by every layer.

An fp8 cache (torch.float8_e4m3fn, `--kv-cache-dtype fp8`) stores `x / scale` saturated to +-448
(`quantize_kv`, the same values as the Triton kernels' `quantize_fp8_e4m3`); reads widen it to
q's dtype and multiply by the scale before the math. With a power-of-two block size up to 64 it
also stores V transposed within each block, [kvh, d, block_size] (`v_transposed`, `v_blocks`; why:
kernels/attention.py). K, and V of every other cache, are [block_size, kvh, d] per block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


FP8_E4M3_MAX = 448.0


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V as the cache stores it: fp8 holds x / scale (fp32 IEEE division, then clamped so
    out-of-range values saturate instead of becoming NaN, then rounded to nearest even); other
    dtypes are a plain cast. The scale divides as a 0-dim tensor: CUDA torch multiplies by the
    reciprocal of a Python-number divisor, which can differ from the division in the last bit."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    y = x.float()
    if scale != 1.0:
        y = y / torch.full((), scale, dtype=torch.float32, device=x.device)
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


V_TRANSPOSE_FP8 = True   # bench/gpu_fp8_vt_probe.py turns it off to time the layout of before in one run


def v_transposed_for(dtype: torch.dtype, block_size: int) -> bool:
    """Whether a cache of this dtype and block size stores V per block as [kvh, d, block_size]:
    fp8 caches whose block size is a power of two up to 64 (the Triton kernel loads a block's keys
    as one vector)."""
    bs = block_size
    return V_TRANSPOSE_FP8 and dtype == torch.float8_e4m3fn and bs & (bs - 1) == 0 and bs <= 64


def v_transposed(kv_cache: torch.Tensor) -> bool:
    """v_transposed_for this layer cache ([2, NB, BS, kvh, d])."""
    return v_transposed_for(kv_cache.dtype, kv_cache.shape[2])


def v_blocks(kv_cache: torch.Tensor, transposed: bool | None = None) -> torch.Tensor:
    """V of one layer's cache as [num_blocks, block_size, kvh, d], whatever its storage order (a
    permuted view where V is stored transposed; writes through it reach the cache). `transposed`
    overrides v_transposed, for a uint8 view of an fp8 cache."""
    v = kv_cache[1]
    if not (v_transposed(kv_cache) if transposed is None else transposed):
        return v
    nb, bs, kvh, d = v.shape
    return v.view(nb, kvh, d, bs).permute(0, 3, 1, 2)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache contents in q's dtype: fp8 widened (exact) and multiplied by its scale."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale


@dataclass(frozen=True)
class SeqSchedule:
    """One scheduled sequence as the attention sees it."""

    block_ids: list[int]
    num_computed_tokens: int   # tokens whose K/V is already in the cache
    num_scheduled_tokens: int  # query tokens run this step

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens


@dataclass
class PrefillSeq:
    q_start: int                  # row of the first query token in the flattened batch
    q_end: int
    block_ids: torch.Tensor       # [num_blocks_needed] long
    context_len: int
    mask: torch.Tensor | None     # [q_len, context_len] bool (True = attend); None = plain causal


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor                 # [T] long: cache slot of each query token
    num_decode: int = 0                        # rows [0, num_decode) are single-token sequences
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None = None    # [B, 1, 1, L] bool, L = max context of the group
    prefills: list[PrefillSeq] = field(default_factory=list)


def build_attn_metadata(seqs: list[SeqSchedule], block_size: int, device: torch.device,
                        sliding_window: int | None = None) -> AttnMetadata:
    """Metadata for sequences laid out back to back; single-token ones must come first."""
    slots: list[torch.Tensor] = []
    num_decode = 0
    while num_decode < len(seqs) and seqs[num_decode].num_scheduled_tokens == 1:
        num_decode += 1
    if any(s.num_scheduled_tokens == 1 for s in seqs[num_decode:]):
        raise ValueError("single-token sequences must be ordered first")
    for s in seqs:
        pos = torch.arange(s.num_computed_tokens, s.context_len)
        table = torch.tensor(s.block_ids, dtype=torch.long)
        slots.append(table.index_select(0, pos // block_size) * block_size + pos % block_size)
    meta = AttnMetadata(slot_mapping=torch.cat(slots).to(device) if slots else
                        torch.empty(0, dtype=torch.long, device=device), num_decode=num_decode)
    if num_decode:
        dec = seqs[:num_decode]
        ctx = torch.tensor([s.context_len for s in dec])
        max_ctx = int(ctx.max())
        max_blocks = -(-max_ctx // block_size)
        tables = torch.zeros(num_decode, max_blocks, dtype=torch.long)
        for i, s in enumerate(dec):
            n = -(-s.context_len // block_size)
            tables[i, :n] = torch.tensor(s.block_ids[:n], dtype=torch.long)
        key_pos = torch.arange(max_ctx)
        mask = key_pos[None, :] < ctx[:, None]                      # [B, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (ctx[:, None] - 1 - sliding_window)
        meta.decode_block_tables = tables.to(device)
        meta.decode_mask = mask[:, None, None, :].to(device)
    start = num_decode
    for s in seqs[num_decode:]:
        q_len, ctx = s.num_scheduled_tokens, s.context_len
        n = -(-ctx // block_size)
        mask = None
        window_bites = sliding_window is not None and ctx > sliding_window
        if s.num_computed_tokens > 0 or window_bites:
            q_pos = torch.arange(s.num_computed_tokens, ctx)[:, None]   # [q_len, 1]
            k_pos = torch.arange(ctx)[None, :]                          # [1, ctx]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            mask = mask.to(device)
        meta.prefills.append(PrefillSeq(
            q_start=start, q_end=start + q_len,
            block_ids=torch.tensor(s.block_ids[:n], dtype=torch.long, device=device),
            context_len=ctx, mask=mask))
        start += q_len
    return meta


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter this step's K/V ([T, kvh, d]) into their cache slots (fp8: quantized)."""
    _, nb, bs, kvh, d = kv_cache.shape
    if kv_cache.dtype == torch.float8_e4m3fn:
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes.
        raw = kv_cache.view(torch.uint8)
        raw[0].view(nb * bs, kvh, d).index_copy_(
            0, slot_mapping, quantize_kv(k, kv_cache.dtype, k_scale).view(torch.uint8))
        vq = quantize_kv(v, kv_cache.dtype, v_scale).view(torch.uint8)
        if v_transposed(kv_cache):
            v_blocks(raw, True)[slot_mapping // bs, slot_mapping % bs] = vq
        else:
            raw[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, vq)
        return
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     mask: torch.Tensor, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, nh, d] -> [B, nh, d], one query per sequence over its gathered context."""
    b, nh, d = q.shape
    kvh = kv_cache.shape[3]
    max_ctx = mask.shape[-1]
    # [B, max_blocks, bs, kvh, d] -> [B, kvh, L, d]; padding is masked out.
    # index_select, not kv_cache[0][tables]: advanced indexing costs time proportional to the
    # whole cache on CPU (milliseconds per layer), index_select only to what it copies.
    flat = block_tables.view(-1)
    k = kv_cache[0].index_select(0, flat).view(b, -1, kvh, d)[:, :max_ctx].transpose(1, 2)
    v = v_blocks(kv_cache).index_select(0, flat).view(b, -1, kvh, d)[:, :max_ctx].transpose(1, 2)
    k, v = dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale)
    # GQA without repeating K/V: query head h uses kv head h // g (HF repeat_kv order), so
    # the g query heads of one kv head act as g "query positions" of that head.
    qg = q.view(b, kvh, nh // kvh, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, nh, d)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq,
                      scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q: [q_len, nh, d] -> [q_len, nh, d], causal over cached prefix + this chunk."""
    q_len, nh, d = q.shape
    kvh = kv_cache.shape[3]
    ctx = seq.context_len
    k = kv_cache[0].index_select(0, seq.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1)[None]
    v = v_blocks(kv_cache).index_select(0, seq.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1)[None]
    k, v = dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale)
    # k, v: [1, kvh, ctx, d]
    qh = q.transpose(0, 1)[None]                                                  # [1, nh, q_len, d]
    if seq.mask is None:  # chunk starts at position 0: plain causal (q_len == ctx)
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                             enable_gqa=kvh != nh)
    else:
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=seq.mask, scale=scale,
                                             enable_gqa=kvh != nh)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttnMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q: [T, nh, d], k/v: [T, kvh, d] -> [T, nh, d]. Writes k/v into the cache first; an fp8
    cache holds k / k_scale and v / v_scale (the scales matter only there)."""
    write_kv(kv_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    sc = (k_scale, v_scale)
    if not meta.prefills:
        return decode_attention(q, kv_cache, meta.decode_block_tables, meta.decode_mask, scale, *sc)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = decode_attention(q[:meta.num_decode], kv_cache,
                                                 meta.decode_block_tables, meta.decode_mask, scale, *sc)
    for seq in meta.prefills:
        out[seq.q_start:seq.q_end] = prefill_attention(q[seq.q_start:seq.q_end], kv_cache, seq, scale, *sc)
    return out
