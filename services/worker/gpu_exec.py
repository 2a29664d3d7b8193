"""GPU step execution: persistent device input buffers, the Triton forward, CUDA graphs for
decode-only steps (padded batch buckets).

Per step the host writes the flattened inputs into pinned staging buffers and copies them to
their persistent device twins in two asynchronous copies; every kernel reads views of those
buffers, so a captured graph replays on whatever the last copy put there. The only host
synchronisation of a step is reading the sampled ids (sampling.py).

Device buffers (N = max_num_tokens, S = max_num_seqs, MB = max blocks per sequence):
  i64 [4 * N + S] holds, for a step of T tokens (T = the padded batch of a graph bucket), four
      contiguous rows of T at [0, 4T): input ids, positions, slot mapping (-1 = padding: the KV
      write skips it), id source (>= 0: the id is prev_tokens[src], sampled by the step before,
      which the host has not read yet; -1: the host's id). One copy of 4T values per step. A
      mixed step (decodes and prompt chunks, eager) adds its sequence ids at [4T, 4T + S),
      decodes first (the two attention launches' seq_ids), in the same copy.
  i32 [(S + 1) + S + S * MB]: query start locations, seq lens, block tables (row stride MB);
      a step copies the prefix up to its last table row.
  prev_tokens [S] long: the sampler writes each step's ids here (runner.py's overlap).

Staging is double-buffered: with step overlap the host fills step N+1's inputs while step N may
not have copied its own yet, so consecutive steps use alternate pinned buffers, and a buffer is
refilled only after the event recorded behind its last copy.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from services.worker.attention import SeqSchedule
from services.worker.gpu_staging import Staging, copy_i32, fill_tables
from services.worker.sampling import to_device
from services.worker.kernels.attention import decode_splits
from services.worker.models.llama import LlamaModel
from services.worker.models.llama_triton import KernelAttnInputs, compute_logits_triton, forward_triton

log = logging.getLogger(__name__)

# Mixed steps attend in two launches (decodes, then prompt chunks: llama_triton.attend); False: one
# prefill-shaped launch for all (bench/gpu_decode.mixed_parts times both in one run).
SPLIT_MIXED = True
# Decode graphs leave their logits in the model's dtype (sampling.sample_async widens them where a
# row needs it); True: widened to float32 inside the graph, as before 2026-12-06 (bench/gpu_fp8.py's
# float_logits mode).
GRAPH_LOGITS_FLOAT = False
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class GpuExecutor:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int, *,
                 max_num_tokens: int = 8192, max_num_seqs: int = 512,
                 graph_sizes: Sequence[int] | None = DEFAULT_GRAPH_SIZES) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_tokens, self.max_seqs = max_num_tokens, max_num_seqs
        self.max_blocks = -(-model.max_model_len // block_size)
        dev = model.device
        s, mb = max_num_seqs, self.max_blocks
        self.i64 = torch.zeros(4 * max_num_tokens + max_num_seqs, dtype=torch.long, device=dev)
        self.prev_tokens = torch.zeros(max_num_seqs, dtype=torch.long, device=dev)
        self.i32 = torch.zeros(2 * s + 1 + s * mb, dtype=torch.int32, device=dev)
        self.qsl = self.i32[:s + 1]
        self.lens = self.i32[s + 1:2 * s + 1]
        self.tables = self.i32[2 * s + 1:].view(s, mb)
        self.packed_tables = torch.zeros(s * mb, dtype=torch.int32, device=dev)   # gpu_staging.copy_i32
        # Pinned staging so the copies are asynchronous (CPU runs, under the Triton interpreter in
        # tests, use plain memory); two sets, used by alternate steps.
        pin = dev.type == "cuda"
        self._staging = [Staging(self.i64.shape[0], self.i32.shape[0], s, mb, pin) for _ in range(2)]
        self._turn = 0
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if pin else 4
        self.graph_sizes = sorted(b for b in (graph_sizes or ()) if b <= max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.verify = None            # gpu_verify.VerifyGraphs with speculative decoding

    # ---- inputs ---------------------------------------------------------------------------
    def _stage(self, ids: list[int], positions: list[int], seqs: list[SeqSchedule], pad_to: int = 0,
               src: list[int] | None = None, seq_order: np.ndarray | None = None) -> int:
        """Fill a pinned buffer set and copy it to the device (async, stream-ordered) -> T, the
        row length of this step's i64 layout (tokens, or the padded graph batch). seq_order: the
        sequence ids to stage after the four rows (a mixed step's decodes, then the rest)."""
        t, n = len(ids), len(seqs)
        bs = self.block_size
        st = self._staging[self._turn]
        self._turn ^= 1
        st.wait()
        rows, toks = max(n, pad_to), max(t, pad_to)
        n64 = st.n64[:4 * toks].reshape(4, toks)
        n64[0, :t] = ids
        n64[3, :t] = -1 if src is None else src
        pos = np.asarray(positions, dtype=np.int64)
        n64[1, :t] = pos
        counts = fill_tables(st, seqs, bs)
        tables = st.n_tables
        st.n_qsl[0] = 0
        st.n_qsl[1:n + 1] = np.cumsum(counts)
        seq_of_token = np.repeat(np.arange(n), counts)                            # [T]
        n64[2, :t] = tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        if pad_to > n:  # CUDA-graph padding rows: one token each, context 0, slot -1
            n64[0:2, t:pad_to] = 0
            n64[2:4, t:pad_to] = -1
            st.n_lens[n:pad_to] = 0
            st.n_qsl[n + 1:pad_to + 1] = np.arange(t + 1, t + 1 + pad_to - n)
        n_ids = 0 if seq_order is None else len(seq_order)
        if n_ids:
            st.n64[4 * toks:4 * toks + n_ids] = seq_order
        # Contiguous prefixes: pinned -> device stays asynchronous.
        self.i64[:4 * toks + n_ids].copy_(st.h64[:4 * toks + n_ids], non_blocking=True)
        copy_i32(self, st, rows, bs)
        st.record()
        return toks

    def _row(self, r: int, t: int) -> torch.Tensor:
        """Row r (0 ids, 1 positions, 2 slots, 3 id sources) of a step laid out with row length t."""
        return self.i64[r * t:(r + 1) * t]

    def _attn(self, num_tokens: int, num_seqs: int, max_query_len: int) -> KernelAttnInputs:
        splits = decode_splits(num_seqs, self.model.cfg.num_kv_heads, self.num_sms) if max_query_len == 1 else 1
        return KernelAttnInputs(self._row(2, num_tokens), self.tables[:num_seqs], self.qsl[:num_seqs + 1],
                                self.lens[:num_seqs], max_query_len, splits)

    # ---- execution ------------------------------------------------------------------------
    def run(self, ids: list[int], positions: list[int], seqs: list[SeqSchedule],
            sample_rows: list[int], src: list[int] | None = None,
            keep_hidden: bool = False, scratch: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One step -> (logits [len(sample_rows), V] of the rows that sample (None: none): float32,
        or the model's dtype from a decode graph (widening 256 x 128k logits in the graph cost an
        H100 ~0.15 ms a step; sampling.sample_async widens them where it must),
        the final hidden states [T, H] of every row when `keep_hidden` (prompt logprobs read
        them; such a step runs eagerly), else None). Nothing waits for the device. `src` (one per
        token, -1: use ids) points tokens at the previous step's sampled ids in prev_tokens (see
        the module docstring). `scratch` (warm_eager): an eager step that writes no KV (slots -1)."""
        t, n = len(ids), len(seqs)
        if t > self.max_tokens or n > self.max_seqs:
            raise ValueError(f"step of {t} tokens / {n} sequences exceeds the executor's "
                             f"{self.max_tokens} / {self.max_seqs}")
        if self.verify is not None and t > n and not keep_hidden and sample_rows and not scratch:
            key = self.verify.key(seqs, t, sample_rows)
            if key is not None:
                return self.verify.run(key, ids, positions, seqs, src), None
        decode_only = t == n and len(sample_rows) == n and not keep_hidden and not scratch
        bucket = next((b for b in self.graph_sizes if b >= n), None) if decode_only else None
        if bucket is not None:
            self._stage(ids, positions, seqs, pad_to=bucket, src=src)
            entry = self.graphs.get(bucket)
            if entry is None:  # not captured at start-up (capture_all skipped, or this one dropped)
                entry = self._capture(bucket)
                log.info("captured decode CUDA graph for batch %d", bucket)
            graph, logits = entry
            graph.replay()
            return logits[:n], None
        counts = np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=n)
        ones = counts == 1
        n_dec = int(ones.sum())
        mixed = SPLIT_MIXED and 0 < n_dec < n
        order = np.concatenate([np.flatnonzero(ones), np.flatnonzero(~ones)]) if mixed else None
        self._stage(ids, positions, seqs, src=src, seq_order=order)
        if scratch:
            self._row(2, t).fill_(-1)
        use_src = src is not None
        attn = self._attn(t, n, int(counts.max()))
        if mixed:   # two attention launches: decode tiles for the decodes (see llama_triton.attend)
            base = 4 * t
            attn.decode_ids, attn.prefill_ids = self.i64[base:base + n_dec], self.i64[base + n_dec:base + n]
            attn.max_query_len = int(counts[~ones].max())
            attn.decode_splits = decode_splits(n_dec, self.model.cfg.num_kv_heads, self.num_sms)
        hidden = self._forward(t, n, attn, use_src)   # [T, H]
        kept = hidden if keep_hidden else None
        if not sample_rows:
            return None, kept
        rows = to_device(sample_rows, torch.long, hidden.device) if sample_rows != list(range(t)) else None
        last = hidden if rows is None else hidden.index_select(0, rows)
        return compute_logits_triton(self.model, last), kept

    def _forward(self, t: int, n: int, attn: KernelAttnInputs | None = None, use_src: bool = True) -> torch.Tensor:
        """Decode graphs (attn None: a decode-only step of n rows) always resolve ids through the
        src row (a replay cannot choose)."""
        return forward_triton(self.model, self._row(0, t), self._row(1, t),
                              attn if attn is not None else self._attn(t, n, 1), self.kv_caches,
                              self._row(3, t) if use_src else None, self.prev_tokens)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture forward + logits (the model's dtype) of a decode step of b rows (inputs already
        staged)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles kernels, settles the allocator
            for _ in range(2):
                compute_logits_triton(self.model, self._forward(b, b), as_float=GRAPH_LOGITS_FLOAT)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = compute_logits_triton(self.model, self._forward(b, b), as_float=GRAPH_LOGITS_FLOAT)
        self.graphs[b] = (graph, logits)
        log.debug("captured decode CUDA graph for batch %d", b)
        return graph, logits

    def capture_all(self, sizes: Sequence[int] | None = None) -> None:
        """Capture every bucket up front (largest first, so smaller ones reuse its pool). The
        runner calls it through capture_at_startup, right after allocating the cache they point into."""
        for b in sorted(sizes or self.graph_sizes, reverse=True):
            if b not in self.graphs:
                self._stage([], [], [], pad_to=b)   # padding rows only: nothing touches the cache
                self._capture(b)

    def capture_verify(self, max_drafts: int) -> float:
        """Speculative decoding: graphs for verify steps of up to max_drafts drafts per row
        (gpu_verify.py) -> seconds taken. Nothing with eager execution (no decode graphs)."""
        if not self.graph_sizes:
            return 0.0
        from services.worker.gpu_verify import VerifyGraphs
        self.verify = VerifyGraphs(self, max_drafts)
        return self.verify.capture_all()

    def warm_shapes(self) -> list[list[tuple[int, int]]]:
        """The eager steps warm_eager runs, each a list of (computed, scheduled) per sequence.
        Triton compiles a kernel apart for each constexpr and for each integer or pointer argument
        that is or is not a multiple of 16 (bytes, for pointers), so: whole prompts and a chunk
        after a prefix with T odd and even (the positions row starts at 8T bytes, the id sources'
        at 24T); mixed steps in every split-KV class of the decode launch (decode_splits of the
        decode count is a constexpr), each with T odd and even, and with odd and even decode
        counts (the prompts' sequence ids start 8 bytes a decode into the staging buffer); without
        decode graphs, decode-only steps of each class and both parities."""
        kvh = self.model.cfg.num_kv_heads
        shapes = [[(0, 16)], [(0, 17)], [(8, 9)]]
        classes: dict[int, int] = {}
        for n in range(1, self.max_seqs):
            classes.setdefault(decode_splits(n, kvh, self.num_sms), n)
        counts = sorted(set(classes.values()) | {2})           # 2: an even decode count
        for n in counts:
            shapes += [[(4, 1)] * n + [(0, 9)], [(4, 1)] * n + [(0, 10)]]
            if not self.graph_sizes:
                shapes += [[(4, 1)] * n, [(4, 1)] * (n + 1)]
        return [sh for sh in shapes if len(sh) <= self.max_seqs and sum(s for _, s in sh) <= self.max_tokens]

    def warm_eager(self, shapes: list[list[tuple[int, int]]] | None = None) -> float:
        """Run every warm_shapes step once, eagerly and writing nothing to the cache, so that
        Triton compiles those kernel variants now and not at the first such step of serving (on
        an H100 an 8B offline run's first mixed steps stalled 2.8-3.2 s; bench/gpu_fp8.py).
        `shapes`: these instead of warm_shapes(). -> seconds taken."""
        t0 = time.perf_counter()
        bs = self.block_size
        shapes = self.warm_shapes() if shapes is None else shapes
        for shape in shapes:
            seqs = [SeqSchedule([0] * -(-(c + s) // bs), c, s) for c, s in shape]
            positions = [p for c, s in shape for p in range(c, c + s)]
            ends = np.cumsum([s for _, s in shape]) - 1
            # Decodes take their ids from the previous step's samples, as with async scheduling.
            src = [i if s == 1 else -1 for i, (_, s) in enumerate(shape) for _ in range(s)]
            self.run([0] * len(positions), positions, seqs, [int(e) for e in ends],
                     src=src if max(src) >= 0 else None, scratch=True)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        took = time.perf_counter() - t0
        log.info("warmed %d eager step shapes in %.1f s", len(shapes), took)
        return took

    def capture_at_startup(self) -> float:
        """capture_all, timed and logged in one line -> seconds taken. A failed capture (e.g. out
        of memory) leaves the executor running every step eagerly: the worker serves, slower."""
        t0 = time.perf_counter()
        try:
            self.capture_all()
            torch.cuda.synchronize(self.model.device)
        except Exception as exc:  # noqa: BLE001 - the eager path needs none of it
            log.warning("CUDA graph capture failed (%s: %s): decode steps run eagerly", type(exc).__name__, exc)
            self.graphs.clear()
            self.graph_sizes = []
            self.pool = None
            return 0.0
        took = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs in %.1f s (batch sizes %d..%d)", len(self.graphs), took,
                 self.graph_sizes[0], self.graph_sizes[-1])
        return took
