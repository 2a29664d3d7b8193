"""Device-fed speculative steps in two launches (spec/device_steps.py, gpu_fed.py): the n-gram
proposal and the step's inputs for every row in one kernel before the forward, and the accepted
tokens appended to the rows' device history in one kernel behind the sampler. Their torch twins
are spec/device_ngram.py's propose / inputs / commit (the CPU runner's path; the tests check the
kernels against them under the interpreter).

Feed (one program per row): the row's history is `hist[slot, LEAD:LEAD + L]` (PAD before it). For
every possible match end e <= L - 2, the run of equal tokens walking back from e against the
history's suffix (at most N_MAX); the best end has the longest run (>= N_MIN), the latest among
those; the drafts are what followed it, up to the row's k. Then the row's Q tokens: its last token
and its drafts (0 where none), positions p + j (p = L - 1), KV slots from the block table (-1 past
the row's cap), the context length p + Q (the stride-Q layout), and p - start_lo (the shift of
random rows' draw positions). With chains (CH > 0: spec/device_chains.py) the drafts are the
chain's tokens after its head, where the head equals the row's tokens past the anchor and a draft
follows; elsewhere the n-gram search's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.pdl import launch_args, wait_prior

PAD = tl.constexpr(-2)
BIG = tl.constexpr(1 << 40)


@triton.jit
def _feed_kernel(hist_ptr, hlen_ptr, meta_ptr, chains_ptr, tables_ptr, drafts_ptr, ids_ptr, pos_ptr, kv_ptr,
                 src_ptr, lens_ptr, shift_ptr, n, width, mb, limit,
                 LEAD: tl.constexpr, N_MIN: tl.constexpr, N_MAX: tl.constexpr, Q: tl.constexpr,
                 QP: tl.constexpr, BS: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr = 0,
                 CHP: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    wait_prior(USE_PDL)
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(meta_ptr + i)
    k = tl.load(meta_ptr + n + i)
    cap = tl.load(meta_ptr + 2 * n + i)
    lo = tl.load(meta_ptr + 3 * n + i)
    base = hist_ptr + slot * width + LEAD
    length = tl.load(hlen_ptr + slot)
    j = tl.arange(0, QP).to(tl.int64)
    # The n-gram search: the method's own proposal, and a host chain's stand-in where it broke.
    best = tl.full((), -1, tl.int64)
    for e0 in range(0, length - 1, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E).to(tl.int64)
        alive = e <= length - 2
        run = tl.zeros((BLOCK_E,), tl.int64)
        for t in tl.static_range(N_MAX):
            s_t = tl.load(base + length - 1 - t)
            tok = tl.load(base + e - t, mask=alive, other=PAD)
            alive = alive & (tok == s_t)
            run += alive.to(tl.int64)
        score = tl.where(run >= N_MIN, run * BIG + e, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    found = (j * 0 + best) >= 0
    e_best = best % BIG
    c_d = e_best + 1 + j
    d_ok = found & (j < Q - 1) & (j < k) & (c_d < length)
    d = tl.load(base + c_d, mask=d_ok, other=-1).to(tl.int64)
    # Token j >= 1 of the row is draft j - 1 (0 where none).
    c_prev = e_best + j
    prev_ok = found & (j >= 1) & (j - 1 < k) & (c_prev < length) & (j < Q)
    prev = tl.load(base + c_prev, mask=prev_ok, other=0).to(tl.int64)
    if CH > 0:
        # A chain (spec/device_chains.py) counts where its head is the tokens emitted since its
        # anchor and it has a draft after them.
        cbase = chains_ptr + i * (CH + 1)
        anchor = tl.load(cbase)
        m = length - anchor
        c = tl.arange(0, CHP).to(tl.int64)
        head = c < m
        chain = tl.load(cbase + 1 + c, mask=c < CH, other=-1)
        seen = tl.load(base + anchor + c, mask=head, other=0).to(tl.int64)
        bad = tl.sum((head & (seen != chain)).to(tl.int32), axis=0)
        first = tl.load(cbase + 1 + m, mask=(bad == 0) & (m < CH), other=-1)
        held = (j * 0 + bad == 0) & (j * 0 + m < CH) & (j * 0 + first >= 0) & (j * 0 + k > 0)
        c_ok = held & (j < Q - 1) & (j < k) & (m + j < CH)
        d = tl.where(held, tl.load(cbase + 1 + m + j, mask=c_ok, other=-1), d)
        cp_ok = held & (j >= 1) & (j - 1 < k) & (m + j - 1 < CH) & (j < Q)
        prev_c = tl.load(cbase + m + j, mask=cp_ok, other=0)
        prev = tl.where(held, tl.where(prev_c < 0, 0, prev_c), prev)
    tl.store(drafts_ptr + i * (Q - 1) + j, d, mask=j < Q - 1)
    p = length - 1
    tok0 = tl.load(base + p).to(tl.int64)
    q_ok = j < Q
    pos = p + j
    pos_c = tl.minimum(pos, cap - 1)
    blk = tl.load(tables_ptr + i * mb + pos_c // BS, mask=q_ok, other=0).to(tl.int64)
    kv = tl.where(pos < cap, blk * BS + pos_c % BS, -1)
    out = i * Q + j
    tl.store(ids_ptr + out, tl.where(j == 0, tok0, prev), mask=q_ok)
    tl.store(pos_ptr + out, pos_c, mask=q_ok)
    tl.store(kv_ptr + out, kv, mask=q_ok)
    tl.store(src_ptr + out, tl.full((QP,), -1, tl.int64), mask=q_ok)
    tl.store(lens_ptr + i, tl.minimum(p + Q, limit).to(tl.int32))
    tl.store(shift_ptr + i, p - lo)


def feed(hist: torch.Tensor, hlen: torch.Tensor, meta: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
         lens: torch.Tensor, *, lead: int, n_min: int, n_max: int, q: int, block_size: int,
         limit: int, chains: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """meta [4, n] long (slot, drafts wanted, cap, start_lo per row); tables [>= n, MB] int32;
    rows [4, >= n * q] long views (ids, positions, KV slots, id sources) written at [i * q + j];
    lens [>= n] int32; chains [n, CH + 1] long contiguous (anchor, then CH chain tokens, -1 padded)
    for host chains (spec/device_chains.py) instead of the n-gram search -> (drafts [n, q - 1]
    long, -1 where none; shift [n] long)."""
    n = meta.shape[1]
    drafts = torch.empty(n, max(q - 1, 1), dtype=torch.long, device=hist.device)
    shift = torch.empty(n, dtype=torch.long, device=hist.device)
    ch = 0 if chains is None else chains.shape[1] - 1
    _feed_kernel[(n,)](hist, hlen, meta, meta if chains is None else chains, tables, drafts, rows[0], rows[1],
                       rows[2], rows[3], lens, shift, n, hist.stride(0), tables.stride(0), limit, LEAD=lead,
                       N_MIN=n_min, N_MAX=n_max, Q=q, QP=triton.next_power_of_2(q), BS=block_size, BLOCK_E=1024,
                       CH=ch, CHP=triton.next_power_of_2(max(ch, 1)), num_warps=4, **launch_args(meta[0]))
    return drafts[:, :q - 1], shift


@triton.jit
def _commit_kernel(hist_ptr, hlen_ptr, slots_ptr, drafts_ptr, sampled_ptr, width, max_len,
                   LEAD: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_prior(USE_PDL)
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    length = tl.load(hlen_ptr + slot)
    j = tl.arange(0, QP).to(tl.int64)
    x = tl.load(sampled_ptr + i * Q + j, mask=j < Q, other=0)
    d = tl.load(drafts_ptr + i * (Q - 1) + j, mask=j < Q - 1, other=-3)
    stop = (j >= Q - 1) | (x != d)
    acc = tl.min(tl.where(stop, j, QP), axis=0)
    cols = tl.minimum(LEAD + length + j, width - 1)
    tl.store(hist_ptr + slot * width + cols, x.to(tl.int32), mask=j < Q)
    tl.store(hlen_ptr + slot, tl.minimum(length + acc + 1, max_len + 1))


def commit(hist: torch.Tensor, hlen: torch.Tensor, slots: torch.Tensor, drafts: torch.Tensor, sampled: torch.Tensor,
           *, lead: int, max_len: int) -> None:
    """sampled [n, q] long contiguous, drafts [n, q - 1] (a view of feed's) -> the accepted drafts
    and the token after them appended to each row (device_ngram.DeviceNgram.commit's twin)."""
    n, q = sampled.shape
    d = drafts.contiguous() if q > 1 else torch.empty(n, 1, dtype=torch.long, device=hist.device)
    _commit_kernel[(n,)](hist, hlen, slots, d, sampled, hist.stride(0), max_len, LEAD=lead, Q=q,
                         QP=triton.next_power_of_2(q), num_warps=1, **launch_args(slots))
