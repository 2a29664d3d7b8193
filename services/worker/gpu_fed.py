"""A device-fed step on the GPU executor (spec/device_steps.py): the host stages only the block
tables and the layout; one kernel (kernels/spec_fed.feed) proposes each row's n-gram drafts (or
takes them from the host's chain: spec/device_chains.py) and
writes the real rows' input ids, positions, KV slots and context lengths from the device's own
lengths, then the step replays the verify graph of
(batch, q) (gpu_verify.py's stride-q layout) or, at q = 1, the decode graph of its batch; without
one it runs the same layout eagerly (the CPU twin in tests, under the Triton interpreter).

Row i (of n real ones) runs its last token at position p_i = length_i - 1 and its drafts after it;
slots past the row's allocated blocks or max_model_len write no KV (only a step in flight for a
request that already ended can reach there)."""
from __future__ import annotations

import torch

from services.worker.attention import SeqSchedule
from services.worker.gpu_staging import close_layout, fill_tables, open_layout
from services.worker.gpu_verify import VERIFY_BUCKETS
from services.worker.models.llama_triton import compute_logits_triton
from services.worker.spec.device_ngram import PAD


def _stage(ex, tables: list[list[int]], caps: list[int], b: int, q: int) -> None:
    """Padding everywhere, the real rows' block tables, qsl of the stride-q layout (async copy)."""
    st, _ = open_layout(ex, b, q)
    if tables:
        fill_tables(st, [SeqSchedule(blocks, 0, cap) for blocks, cap in zip(tables, caps)], ex.block_size)
    close_layout(ex, st, len(tables), b, q)


def run_fed(ex, dev, tables: list[list[int]], caps: list[int], meta: torch.Tensor,
            q: int, chains: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dev: the spec.device_ngram.DeviceNgram (or device_chains.DeviceChains, with `chains`
    [n, chain_len + 1]); tables / caps: each row's block ids and how many positions they (and
    max_model_len) allow; meta [4, n] long on the device (slot, drafts wanted, cap, start_lo per
    row) -> (float32 logits [n * q, V], row i's j-th token at i * q + j; the drafts [n, q - 1], -1
    where none; each row's position shift past start_lo [n])."""
    from services.worker.kernels.spec_fed import feed
    n = len(tables)
    graph = None
    if q == 1:
        b = next((s for s in ex.graph_sizes if s >= n), n)
        entry = ex.graphs.get(b)
    else:
        b = next((s for s in VERIFY_BUCKETS if s >= n), n) if ex.verify is not None else n
        entry = ex.verify.graphs.get((b, q)) if ex.verify is not None else None
    if entry is not None:
        graph, logits = entry
    _stage(ex, tables, caps, b, q)
    drafts, shift = feed(dev.hist, dev.hlen, meta, ex.tables, ex.i64[:4 * b * q].view(4, b * q), ex.lens,
                         lead=dev.lead, n_min=dev.n_min, n_max=dev.n_max, q=q, block_size=ex.block_size,
                         limit=ex.max_blocks * ex.block_size, chains=chains)
    if graph is not None:
        graph.replay()
    else:
        logits = compute_logits_triton(ex.model, ex._forward(b * q, b, ex._attn(b * q, b, q)))
    return logits[:n * q], drafts, shift


def warm_up(ex, dev, widths: list[int]) -> None:
    """Compile the feed and commit kernels for every width at start-up, on scratch rows, so no
    serving step stalls for a compile: one row, several (PDL differs), and 16 (Triton compiles
    another variant for an integer argument divisible by 16: the row count of 16- and 32-row steps)."""
    from services.worker.kernels.spec_fed import commit, feed
    for q in widths:
        for n in (1, 2, 16):
            if n > min(ex.max_seqs, dev.hlen.shape[0]) or n * q > ex.max_tokens:
                continue
            dev.hlen[:n] = 1
            meta = torch.tensor([list(range(n)), [q - 1] * n, [ex.block_size] * n, [0] * n], dtype=torch.long,
                                device=dev.hlen.device)
            ch = getattr(dev, "chain_len", 0)
            chains = torch.full((n, ch + 1), -1, dtype=torch.long, device=dev.hlen.device) if ch else None
            if chains is not None:
                chains[:, 0] = 1
            drafts, _ = feed(dev.hist, dev.hlen, meta, ex.tables, ex.i64[:4 * n * q].view(4, n * q), ex.lens,
                             lead=dev.lead, n_min=dev.n_min, n_max=dev.n_max, q=q, block_size=ex.block_size,
                             limit=ex.max_blocks * ex.block_size, chains=chains)
            commit(dev.hist, dev.hlen, meta[0], drafts, torch.zeros(n, q, dtype=torch.long, device=dev.hlen.device),
                   lead=dev.lead, max_len=dev.max_len)
    dev.hlen.zero_()
    dev.hist.fill_(PAD)
