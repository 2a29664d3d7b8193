"""Pinned host staging for the GPU executor's persistent device inputs (gpu_exec.py) and the
verify graphs' layout (gpu_verify.py): one set of host buffers mirroring the device ones, the event
behind its last copy, and the block tables / context lengths written into it."""
from __future__ import annotations

import numpy as np
import torch

from services.worker.attention import SeqSchedule


def fill_tables(st: "Staging", seqs: list[SeqSchedule], bs: int) -> np.ndarray:
    """Block tables and context lengths of `seqs` into a staging set -> their query counts."""
    counts = np.empty(len(seqs), dtype=np.int64)
    owners, tables = st.row_owner, st.n_tables
    for i, sq in enumerate(seqs):
        nb = -(-sq.context_len // bs)
        blocks = sq.block_ids
        # Block tables only grow (the runner extends each request's list in place), so a row
        # that held this very list in this buffer needs only its new blocks written.
        owner, written = owners[i]
        start = written if owner is blocks and written <= nb else 0
        if start < nb:
            tables[i, start:nb] = blocks[start:nb]
        owners[i] = (blocks, nb)
        st.n_lens[i] = sq.context_len
        counts[i] = sq.num_scheduled_tokens
    return counts


def open_layout(ex, b: int, q: int) -> tuple["Staging", np.ndarray]:
    """The executor's next staging set for a stride-q step of b sequences (gpu_verify.py,
    gpu_fed.py), every token padding (id 0, position 0, no KV slot, host id) -> (set, its [4, b*q]
    i64 rows)."""
    st = ex._staging[ex._turn]
    ex._turn ^= 1
    st.wait()
    n64 = st.n64[:4 * b * q].reshape(4, b * q)
    n64[0:2] = 0
    n64[2:4] = -1
    return st, n64


def close_layout(ex, st: "Staging", n: int, b: int, q: int) -> None:
    """Padding sequences n..b of context 0, query starts every q tokens; copy the set to the
    executor's device buffers (asynchronous, stream-ordered)."""
    st.n_lens[n:b] = 0
    st.n_qsl[:b + 1] = np.arange(b + 1) * q
    t = b * q
    ex.i64[:4 * t].copy_(st.h64[:4 * t], non_blocking=True)
    copy_i32(ex, st, b, bs=ex.block_size)
    st.record()


def copy_i32(ex, st: "Staging", rows: int, bs: int) -> None:
    """Query starts, context lengths and the first `rows` block-table rows to the device
    (asynchronous, stream-ordered). The tables' row stride is the longest model length's block
    count (CUDA graphs read them with that stride), e.g. 8,192 blocks for 131,072 tokens: 16 MiB of
    a 512-row step where the contexts need a few hundred KiB. So only the columns this step's
    longest context needs travel, packed, and a device-side copy spreads them into the rows
    (columns past a row's context are never read)."""
    s, mb = ex.max_seqs, ex.max_blocks
    lens = st.n_lens[:rows]
    width = -(-int(lens.max()) // bs) if rows else 0
    if 2 * width > mb:   # most of the row is in use: one copy of the whole prefix
        used32 = 2 * s + 1 + rows * mb
        ex.i32[:used32].copy_(st.h32[:used32], non_blocking=True)
        return
    ex.i32[:2 * s + 1].copy_(st.h32[:2 * s + 1], non_blocking=True)
    if width:
        n = rows * width
        st.n_packed[:n].reshape(rows, width)[:] = st.n_tables[:rows, :width]
        ex.packed_tables[:n].copy_(st.h_packed[:n], non_blocking=True)
        ex.tables[:rows, :width].copy_(ex.packed_tables[:n].view(rows, width))


class Staging:
    """One set of pinned host buffers mirroring the device inputs, and the event behind the
    last copy out of them."""

    def __init__(self, n64: int, n32: int, max_seqs: int, max_blocks: int, pin: bool) -> None:
        self.h64 = torch.zeros(n64, dtype=torch.long, pin_memory=pin)
        self.h32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.n64, n32v = self.h64.numpy(), self.h32.numpy()
        s = max_seqs
        self.n_qsl = n32v[:s + 1]
        self.n_lens = n32v[s + 1:2 * s + 1]
        self.n_tables = n32v[2 * s + 1:].reshape(s, max_blocks)
        # The tables' used columns packed row after row (copy_i32).
        self.h_packed = torch.zeros(s * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.n_packed = self.h_packed.numpy()
        # Per table row: (the block-id list it was filled from, how many blocks are written).
        self.row_owner: list[tuple[list | None, int]] = [(None, 0)] * s
        self.event = torch.cuda.Event() if pin else None
        self.pending = False

    def wait(self) -> None:
        if self.pending:
            self.event.synchronize()
            self.pending = False

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
            self.pending = True
