"""The draft-model proposer: a smaller model with the target's tokenizer, run by the same worker
with its own paged KV cache, proposes each speculating row's next k tokens greedily.

Its KV cache is its own pool (the target's block count, the target's block size), with its own
block tables: the target's blocks may come from the prefix cache or a KV tier, where no draft KV
was ever written, so sharing the target's block ids would read garbage. Each request keeps
`computed`, how many of its tokens have draft KV. A proposal of k tokens for a context of L
tokens runs, for all its rows at once:

  1. catch-up: tokens [computed, L) in one varlen forward (the whole context the first time,
     usually 1-2 tokens after that); the last row's argmax is draft 1;
  2. k - 1 decode steps, feeding draft j at position L + j - 1 to get draft j + 1 (the ids stay
     on the device: a GPU decode step replays a CUDA graph fed from the executor's prev_tokens);
  3. one read of the [rows, k] drafts to the host.

The drafts fed in step 2 wrote KV at positions L..L+k-2; when the request's next tokens arrive
(extend), the leading ones equal to what was fed keep theirs, so `computed` = L + that count and
the next catch-up starts there. Verification treats the drafts as point-mass proposals (verify.py),
which is exact for any temperature, and is what vLLM does with greedy drafters.

A pool with no room for a row's blocks first frees the least recently used requests that are not
drafting this step (they catch up again later); a row that still has no room gets no drafts."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.worker.attention import SeqSchedule, build_attn_metadata
from services.worker.models.llama import LlamaModel
from services.worker.sampling import to_device

log = logging.getLogger(__name__)

DRAFT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)   # speculation pays at low concurrency


@dataclass
class _DraftSeq:
    tokens: list[int]                       # prompt + every output token the request has
    blocks: list[int] = field(default_factory=list)
    computed: int = 0                       # tokens [0, computed) have draft KV
    fed_at: int = 0                         # drafts fed at positions fed_at.. (step 2 above)
    fed: list[int] = field(default_factory=list)
    fed_dev: tuple | None = None            # chains: (_Fed, row, count) until read (_settle)
    used: int = 0                           # the proposal clock when it last drafted (LRU)


@dataclass
class _Fed:
    """A chain step's drafts on their way to the host: read when the request next drafts (_settle)."""
    host: torch.Tensor                      # [rows, k_max] long (pinned on a GPU)
    event: object | None                    # torch.cuda.Event recorded after the copy (None on a CPU)

    def row(self, i: int, n: int) -> list[int]:
        if self.event is not None:
            self.event.synchronize()        # the draft's part of a step, queued before its forward
            self.event = None
        return self.host[i, :n].tolist()


class DraftModel:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, *, max_num_tokens: int = 8192,
                 cuda_graphs: bool = True) -> None:
        self.model = model
        self.max_tokens = max(1, max_num_tokens)
        self.cuda_graphs = cuda_graphs
        self.seqs: dict[str, _DraftSeq] = {}
        self._clock = 0
        self.proposed = 0                     # rows proposed for, over the process (tests, logs)
        self.allocate(num_blocks, block_size)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    # ---- the pool ------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocate the cache for the target's geometry; every request starts over."""
        self.seqs.clear()
        self.kv_caches = []
        self.gpu = None
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
                          for _ in range(self.model.cfg.num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))
        if self.model.device.type == "cuda":
            from services.worker.gpu_exec import GpuExecutor   # imports triton: GPU only
            self.gpu = GpuExecutor(self.model, self.kv_caches, block_size, max_num_tokens=self.max_tokens,
                                   graph_sizes=DRAFT_GRAPH_SIZES if self.cuda_graphs else None)
            if self.cuda_graphs:
                # Decode steps replay decode graphs; catch-ups of 2 tokens a row (after a run
                # accepted whole) replay verify graphs of q = 2 (gpu_verify.py).
                took = self.gpu.capture_at_startup() + self.gpu.capture_verify(1)
                log.info("draft model: decode graphs captured in %.2fs", took)
        log.info("draft model KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, block_size,
                 num_blocks * self.model.kv_bytes_per_block(block_size, self.model.dtype) / 2**30)

    def reset(self, num_blocks: int, block_size: int) -> None:
        """The scheduler (re)connected: no request survives; the geometry may have changed."""
        if (num_blocks, block_size) != (self.num_blocks, self.block_size):
            self.allocate(num_blocks, block_size)
            return
        for rid in list(self.seqs):
            self.finish(rid)

    def _release(self, seq: _DraftSeq) -> None:
        self._free.extend(seq.blocks)
        seq.blocks, seq.computed, seq.fed, seq.fed_dev = [], 0, [], None

    def _reserve(self, rid: str, seq: _DraftSeq, positions: int, busy: set[str]) -> bool:
        """Blocks for `positions` tokens of draft KV, freeing idle requests' (LRU) if needed."""
        need = -(-positions // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self._free):
            idle = sorted((s.used, r) for r, s in self.seqs.items() if r not in busy and s.blocks)
            if need > len(self._free) + sum(len(self.seqs[r].blocks) for _, r in idle):
                return False             # even every idle request's blocks would not do
            for _, r in idle:
                self._release(self.seqs[r])
                if need <= len(self._free):
                    break
        if need > len(self._free):
            return False
        seq.blocks.extend(self._free.pop() for _ in range(need))
        return True

    # ---- requests --------------------------------------------------------------------------------
    def start(self, request_id: str, token_ids: list[int]) -> None:
        old = self.seqs.pop(request_id, None)
        if old is not None:
            self._release(old)
        self.seqs[request_id] = _DraftSeq(list(token_ids))

    def extend(self, request_id: str, tokens: list[int]) -> None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        seq.tokens.extend(tokens)
        if seq.fed_dev is None:     # (a chain's drafts are compared when next needed: _settle)
            self._match_fed(seq)

    def _settle(self, seq: _DraftSeq) -> None:
        """A chain's fed drafts read (waiting for the draft's part of that step, if still running)
        and compared with the tokens that arrived since."""
        if seq.fed_dev is not None:
            fed, i, n = seq.fed_dev
            seq.fed, seq.fed_dev = fed.row(i, n), None
            self._match_fed(seq)

    @staticmethod
    def _match_fed(seq: _DraftSeq) -> None:
        if seq.fed:
            # The drafts fed past the context keep their KV where the real tokens equal them; while
            # every real token matched, the rest may still match the next ones (chains run ahead).
            real, m = seq.tokens[seq.fed_at:], 0
            while m < len(seq.fed) and m < len(real) and real[m] == seq.fed[m]:
                m += 1
            seq.computed = seq.fed_at + m
            seq.fed_at, seq.fed = (seq.fed_at + m, seq.fed[m:]) if m == len(real) else (seq.fed_at, [])
        seq.computed = min(seq.computed, len(seq.tokens))

    def finish(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._release(seq)

    # ---- proposing -------------------------------------------------------------------------------
    @torch.inference_mode()
    def backlog(self, request_ids) -> int:
        """Tokens the draft must catch up on (a forward over them) before these requests draft:
        every token since each one's last draft (catch-up is lazy: _draft)."""
        return sum(len(s.tokens) - s.computed for s in map(self.seqs.get, request_ids) if s is not None)

    def propose(self, rows: list[tuple[str, int]]) -> dict[str, list[int]]:
        """rows: (request id, k >= 1 drafts wanted) -> its greedy drafts (rows without room: none)."""
        live = self._live(rows)
        if not live:
            return {}
        drafts = self._draft(live).tolist()                             # the one host read
        out = {}
        for (rid, seq, k), row in zip(live, drafts):
            out[rid] = row[:k]
            seq.computed = len(seq.tokens)
            seq.fed_at, seq.fed = len(seq.tokens), row[:k - 1]
        self.proposed += len(live)
        return out

    @torch.inference_mode()
    def propose_chains(self, rows: list[tuple[str, int]], width: int) -> torch.Tensor:
        """Device-fed steps (spec/device_chains.py): rows (request id, tokens wanted, 0 for none)
        -> [len(rows), width] long on the device: each row's greedy continuation of the tokens the
        host has, NO_DRAFT past its length and for rows without room. Nothing is read here: the
        fed tokens reach the host, behind an event, when the request next drafts (_settle)."""
        from services.worker.spec.device_ngram import NO_DRAFT
        out = torch.full((len(rows), width), NO_DRAFT, dtype=torch.long, device=self.model.device)
        index = {rid: i for i, (rid, _) in enumerate(rows)}
        live = self._live([(rid, min(k, width)) for rid, k in rows])
        if not live:
            return out
        drafts = self._draft(live)                                       # [n, k_max]
        k_max = drafts.shape[1]
        # (small host lists go up without a sync: sampling.to_device)
        ks = to_device([k for _, _, k in live], torch.long, drafts.device)
        keep = torch.arange(k_max, device=drafts.device)[None, :] < ks[:, None]
        at = to_device([index[rid] for rid, _, _ in live], torch.long, drafts.device)
        out[at, :k_max] = torch.where(keep, drafts, NO_DRAFT)
        if drafts.device.type == "cuda":
            host = torch.empty(drafts.shape, dtype=torch.long, pin_memory=True)
            host.copy_(drafts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = drafts, None
        fed = _Fed(host, event)
        for i, (rid, seq, k) in enumerate(live):
            seq.computed = len(seq.tokens)
            seq.fed_at, seq.fed, seq.fed_dev = len(seq.tokens), [], (fed, i, k - 1)
        self.proposed += len(live)
        return out

    def _live(self, rows: list[tuple[str, int]]) -> list[tuple[str, _DraftSeq, int]]:
        """The rows that draft: (request id, its sequence, its k within the context and the pool)."""
        self._clock += 1
        busy = {rid for rid, _ in rows}
        live: list[tuple[str, _DraftSeq, int]] = []
        for rid, k in rows:
            seq = self.seqs.get(rid)
            if seq is None or k < 1:
                continue
            self._settle(seq)
            k = min(k, self.max_model_len - len(seq.tokens))
            if k < 1 or not self._reserve(rid, seq, len(seq.tokens) + k - 1, busy):
                continue
            seq.used = self._clock
            live.append((rid, seq, k))
        return live

    def _draft(self, live: list[tuple[str, _DraftSeq, int]]) -> torch.Tensor:
        """Catch-up and k - 1 decode steps for every live row -> [n, k_max] long on the device
        (a row's columns past its k are not its drafts)."""
        firsts = self._catch_up(live)                                    # [n] draft 1 of each row
        k_max = max(k for _, _, k in live)
        cols = [firsts]
        cur = firsts
        for j in range(1, k_max):
            active = [i for i, (_, _, k) in enumerate(live) if k > j]
            idx = to_device(active, torch.long, cur.device) if len(active) < len(live) else None
            feed = cur if idx is None else cur.index_select(0, idx)
            seqs = [SeqSchedule(live[i][1].blocks, len(live[i][1].tokens) + j - 1, 1) for i in active]
            positions = [len(live[i][1].tokens) + j - 1 for i in active]
            nxt = self._decode(feed, positions, seqs)
            if idx is None:
                cur = nxt
            else:
                cur = cur.clone()
                cur.index_copy_(0, idx, nxt)
            cols.append(cur)
        return torch.stack(cols, dim=1)

    def _catch_up(self, live: list[tuple[str, _DraftSeq, int]]) -> torch.Tensor:
        """Run every row's tokens without draft KV, in forwards of at most max_tokens tokens ->
        the argmax after each row's last token, [n] on the device."""
        firsts = torch.zeros(len(live), dtype=torch.long, device=self.model.device)
        # At least the last token runs: its logits give draft 1 (its KV is rewritten as it was).
        todo = [(i, min(seq.computed, len(seq.tokens) - 1), len(seq.tokens)) for i, (_, seq, _) in enumerate(live)]
        while todo:
            pieces, rest, used = [], [], 0
            for i, start, end in todo:
                n = min(end - start, self.max_tokens - used)
                if n <= 0:
                    rest.append((i, start, end))
                    continue
                used += n
                pieces.append((i, start, n, start + n == end))
                if start + n < end:
                    rest.append((i, start + n, end))
            pieces.sort(key=lambda p: p[2] != 1)          # single-token sequences first (attention.py)
            ids: list[int] = []
            positions: list[int] = []
            seqs: list[SeqSchedule] = []
            rows: list[int] = []
            ended: list[int] = []
            for i, start, n, last in pieces:
                seq = live[i][1]
                ids.extend(seq.tokens[start:start + n])
                positions.extend(range(start, start + n))
                seqs.append(SeqSchedule(seq.blocks, start, n))
                if last:
                    rows.append(len(ids) - 1)
                    ended.append(i)
            if self.gpu is not None and self.gpu.verify is not None and len(rows) == len(seqs) \
                    and max(p[2] for p in pieces) == 2:
                # Every row's logits (a verify graph's shape), then the last of each sequence.
                every = self._forward(ids, positions, seqs, list(range(len(ids))))
                logits = every.index_select(0, to_device(rows, torch.long, every.device))
            else:
                logits = self._forward(ids, positions, seqs, rows)
            if ended:
                firsts.index_copy_(0, to_device(ended, torch.long, firsts.device),
                                   logits.argmax(dim=1))
            todo = rest
        return firsts

    def _forward(self, ids: list[int], positions: list[int], seqs: list[SeqSchedule],
                 rows: list[int]) -> torch.Tensor:
        """Host ids -> float32 logits [len(rows), V] of the sampling rows."""
        if self.gpu is not None:
            logits, _ = self.gpu.run(ids, positions, seqs, rows)
            return logits
        device = self.model.device
        meta = build_attn_metadata(seqs, self.block_size, device, self.model.cfg.sliding_window)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=device),
                                    torch.tensor(positions, dtype=torch.long, device=device), meta, self.kv_caches)
        return self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=device)))

    def _decode(self, feed: torch.Tensor, positions: list[int], seqs: list[SeqSchedule]) -> torch.Tensor:
        """One token per row, the ids already on the device -> the next ids [n] (argmax)."""
        n = len(seqs)
        if self.gpu is not None:
            self.gpu.prev_tokens[:n].copy_(feed)
            logits, _ = self.gpu.run([0] * n, positions, seqs, list(range(n)), list(range(n)))
            return logits.argmax(dim=1)
        device = self.model.device
        meta = build_attn_metadata(seqs, self.block_size, device, self.model.cfg.sliding_window)
        hidden = self.model.forward(feed, torch.tensor(positions, dtype=torch.long, device=device), meta,
                                    self.kv_caches)
        return self.model.compute_logits(hidden).argmax(dim=1)

    # ---- cost --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def time_step(self, num_seqs: int, reps: int = 2) -> float:
        """Median seconds of one draft decode step of `num_seqs` rows (start-up calibration: no
        request holds a block, so the first block's garbage KV is overwritten before use)."""
        feed = torch.zeros(num_seqs, dtype=torch.long, device=self.model.device)
        seqs = [SeqSchedule([0], 0, 1) for _ in range(num_seqs)]
        times = []
        for _ in range(reps + 1):
            if self.gpu is not None:
                torch.cuda.synchronize()
            t = time.perf_counter()
            self._decode(feed, [0] * num_seqs, seqs)
            if self.gpu is not None:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times = sorted(times[1:])
        return times[len(times) // 2]


def load_draft_model(cfg, target: LlamaModel, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                     max_num_tokens: int, cuda_graphs: bool) -> DraftModel:
    """The config's draft model on the target's device, checked against the target: its vocabulary
    must fit inside the target's (the same tokenizer was checked at start, spec_config.py).
    Raises ModelConfigError (a clear message) otherwise."""
    from services.worker.models import load_model, load_model_config
    from services.worker.models.config import ModelConfigError
    dcfg = load_model_config(cfg.model)
    if dcfg.vocab_size > target.cfg.vocab_size:
        raise ModelConfigError(f"speculative-config: the draft model's vocabulary ({dcfg.vocab_size} ids) is larger "
                               f"than the target's ({target.cfg.vocab_size}): it could propose ids the target lacks")
    max_len = min(target.max_model_len, dcfg.max_position_embeddings)
    model = load_model(cfg.model, target.device, dtype, max_len)
    return DraftModel(model, num_blocks, block_size, max_num_tokens=max_num_tokens, cuda_graphs=cuda_graphs)
