"""A device-fed step on the GPU executor (spec/device_steps.py): the host stages only the block
tables and the layout; the input ids, positions, KV slots and context lengths of the real rows are
written on the device from the device's own lengths, then the step replays the verify graph of
(batch, q) (gpu_verify.py's stride-q layout) or, at q = 1, the decode graph of its batch; without
one it runs the same layout eagerly (the CPU twin in tests, under the Triton interpreter).

Row i (of n real ones) runs its last token at position p_i = length_i - 1 and its drafts after it;
slots past the row's allocated blocks or max_model_len write no KV (only a step in flight for a
request that already ended can reach there)."""
from __future__ import annotations

import numpy as np
import torch

from services.worker.attention import SeqSchedule
from services.worker.gpu_staging import fill_tables
from services.worker.gpu_verify import VERIFY_BUCKETS
from services.worker.models.llama_triton import compute_logits_triton
from services.worker.sampling import to_device


def _stage(ex, tables: list[list[int]], caps: list[int], b: int, q: int) -> None:
    """Padding everywhere, the real rows' block tables, qsl of the stride-q layout (async copy)."""
    st = ex._staging[ex._turn]
    ex._turn ^= 1
    st.wait()
    t = b * q
    n64 = st.n64[:4 * t].reshape(4, t)
    n64[0:2] = 0
    n64[2:4] = -1
    n = len(tables)
    if n:
        fill_tables(st, [SeqSchedule(blocks, 0, cap) for blocks, cap in zip(tables, caps)], ex.block_size)
    st.n_lens[n:b] = 0
    st.n_qsl[:b + 1] = np.arange(b + 1) * q
    ex.i64[:4 * t].copy_(st.h64[:4 * t], non_blocking=True)
    used32 = 2 * ex.max_seqs + 1 + b * ex.max_blocks
    ex.i32[:used32].copy_(st.h32[:used32], non_blocking=True)
    st.record()


def run_fed(ex, tables: list[list[int]], caps: list[int], tok0: torch.Tensor, drafts: torch.Tensor,
            length: torch.Tensor, q: int) -> torch.Tensor:
    """tables / caps: each row's block ids and how many positions they (and max_model_len) allow;
    tok0 [n], drafts [n, q - 1] (< 0: none), length [n] on the device -> float32 logits [n * q, V]
    (row i's j-th token at i * q + j)."""
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
    dev = tok0.device
    bs = ex.block_size
    p = length - 1
    pos = p[:, None] + torch.arange(q, device=dev)[None, :]                          # [n, q]
    cap = to_device(caps, torch.long, dev)[:, None]
    ok = pos < cap
    pos = torch.minimum(pos, cap - 1)
    blk = ex.tables[:n].long().gather(1, pos // bs)
    v = ex.i64[:4 * b * q].view(4, b, q)
    v[0, :n, 0] = tok0
    if q > 1:
        v[0, :n, 1:] = drafts.clamp(min=0)
    v[1, :n] = pos
    v[2, :n] = torch.where(ok, blk * bs + pos % bs, -1)
    v[3, :n] = -1
    ex.lens[:n] = (p + q).clamp(max=ex.max_blocks * bs).to(torch.int32)
    if graph is not None:
        graph.replay()
    else:
        logits = compute_logits_triton(ex.model, ex._forward(b * q, b, ex._attn(b * q, b, q)))
    return logits[:n * q]
