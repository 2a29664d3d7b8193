"""CUDA graphs for speculative decoding's verify steps: B decode rows, each running its last
known token plus up to q - 1 drafts, every token sampled.

A graph is captured per (padded batch B, q): the step is laid out with a fixed stride of q tokens
per sequence (T = B * q rows of the executor's i64 buffer), so one replay serves any mix of
rows with 1..q tokens. Row i's c real tokens sit at [i*q, i*q + c); the q - c padding tokens
after them write no KV (slot -1) and their logits are never read. The padding follows the real
queries, so the real ones keep their positions: the attention places query j of a sequence at
seq_len - q + j, and seq_len is the real context plus the padding. Padding sequences (i >= n)
have context 0, like the decode graphs' padding rows. The graph computes the logits of all T
rows; the runner's rows are gathered out of them behind the replay.

Captured at start-up when speculation is on (SpecDecoder.calibrate), for a few q up to K + 1 and
the batch buckets up to MAX_VERIFY_BATCH: speculation pays at low concurrency, where a step is
launch-bound and an eager verify step (30+ layers of Python and launches) costs several decode
steps. Anything else (prefill chunks, larger batches) runs eagerly as before."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from services.worker.attention import SeqSchedule
from services.worker.gpu_staging import close_layout, fill_tables, open_layout
from services.worker.models.llama_triton import compute_logits_triton
from services.worker.sampling import to_device

log = logging.getLogger(__name__)

MAX_VERIFY_BATCH = 32
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 24, 32)


def verify_widths(k: int) -> list[int]:
    """The q (tokens per row) with a graph for up to k drafts: k + 1 and a few below it, so a
    step whose rows drafted little does not pay for k + 1 tokens each."""
    return sorted({q for q in (2, 3, 5, 9) if q <= k + 1} | {k + 1})


class VerifyGraphs:
    def __init__(self, ex, max_drafts: int) -> None:
        self.ex = ex
        self.widths = verify_widths(max_drafts)
        self.buckets = [b for b in VERIFY_BUCKETS if b <= min(MAX_VERIFY_BATCH, ex.max_seqs)]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def key(self, seqs: list[SeqSchedule], num_tokens: int, sample_rows: list[int]) -> tuple[int, int] | None:
        """The (B, q) graph that can run this step, or None (eager)."""
        n = len(seqs)
        if not self.buckets or n > self.buckets[-1]:
            return None
        if len(sample_rows) != num_tokens or sample_rows[-1] != num_tokens - 1:   # not every token samples
            return None
        q_max = max(s.num_scheduled_tokens for s in seqs)
        q = next((w for w in self.widths if w >= q_max), None)
        b = next((b for b in self.buckets if b >= n), None)
        if q is None or b is None or (b, q) not in self.graphs:
            return None
        limit = self.ex.max_blocks * self.ex.block_size
        if any(s.context_len + q - s.num_scheduled_tokens > limit for s in seqs):
            return None            # the padding would run past the block-table row
        return b, q

    def _stage(self, ids: list[int], positions: list[int], seqs: list[SeqSchedule], src: list[int] | None,
               b: int, q: int) -> np.ndarray:
        """The executor's staging filled in the stride-q layout -> the real tokens' rows."""
        ex = self.ex
        bs = ex.block_size
        st, n64 = open_layout(ex, b, q)
        n = len(seqs)
        counts = fill_tables(st, seqs, bs) if n else np.zeros(0, dtype=np.int64)
        starts = np.arange(n, dtype=np.int64) * q
        dest = (np.repeat(starts, counts) + np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
                if n else np.zeros(0, dtype=np.int64))
        if n:
            pos = np.asarray(positions, dtype=np.int64)
            n64[0, dest] = ids
            n64[1, dest] = pos
            n64[3, dest] = -1 if src is None else src
            seq_of_token = np.repeat(np.arange(n), counts)
            n64[2, dest] = st.n_tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
            st.n_lens[:n] += (q - counts).astype(st.n_lens.dtype)    # the padding follows the real queries
        close_layout(ex, st, n, b, q)
        return dest

    def run(self, key: tuple[int, int], ids: list[int], positions: list[int], seqs: list[SeqSchedule],
            src: list[int] | None) -> torch.Tensor:
        """Replay the (B, q) graph on this step -> float32 logits of its tokens, in their order."""
        b, q = key
        dest = self._stage(ids, positions, seqs, src, b, q)
        entry = self.graphs.get(key)
        if entry is None:   # the same layout run eagerly (the CPU twin in tests)
            logits = compute_logits_triton(self.ex.model, self.ex._forward(b * q, b, self.ex._attn(b * q, b, q)))
        else:
            graph, logits = entry
            graph.replay()
        return logits.index_select(0, to_device(dest.tolist(), torch.long, logits.device))

    def _capture(self, b: int, q: int) -> None:
        ex = self.ex
        self._stage([], [], [], None, b, q)            # padding only: nothing touches the cache
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                compute_logits_triton(ex.model, ex._forward(b * q, b, ex._attn(b * q, b, q)))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if ex.pool is None:
            ex.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=ex.pool):
            logits = compute_logits_triton(ex.model, ex._forward(b * q, b, ex._attn(b * q, b, q)))
        self.graphs[(b, q)] = (graph, logits)

    def capture_all(self) -> float:
        """Every (B, q) within the executor's token budget, largest first -> seconds taken. A
        failure (e.g. out of memory) leaves verify steps eager."""
        t0 = time.perf_counter()
        try:
            for b in sorted(self.buckets, reverse=True):
                for q in sorted(self.widths, reverse=True):
                    if b * q <= self.ex.max_tokens:
                        self._capture(b, q)
            torch.cuda.synchronize(self.ex.model.device)
        except Exception as exc:  # noqa: BLE001 - the eager path needs none of it
            log.warning("verify CUDA graph capture failed (%s: %s): verify steps run eagerly", type(exc).__name__, exc)
            self.graphs.clear()
            return 0.0
        took = time.perf_counter() - t0
        log.info("captured %d verify CUDA graphs in %.1f s (batch <= %d, tokens per row %s)", len(self.graphs), took,
                 self.buckets[-1] if self.buckets else 0, self.widths)
        return took
