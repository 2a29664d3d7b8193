"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt token but the first, its logprob
given the tokens before it, its rank in the vocabulary, and the top k there, computed during
prefill from the rows the forward produced anyway.

Row r of a request (position p = start + r) predicts the token at p + 1. A prefill chunk
[start, end) therefore scores prompt tokens start + 1 .. end; the token at `start` was scored by
the previous chunk's last row. Targets are read from the request's whole prompt (known on the
host), so a chunk boundary needs nothing carried from one step to the next. The prompt's last row
(p = prompt_len - 1) predicts the first output token: the sampler's, not a prompt logprob. Nothing
predicts position 0 (vLLM answers null there).

Memory: logits of R rows are [R, V] float32 (V = 128k for Llama 3: 1 GB for 2k rows). They are
computed `slice_rows` rows at a time, reduced to (logprob, rank, top-k) and dropped, so no more
than [slice_rows, V] of logits exists at once, whatever the chunk size.

On a GPU nothing here waits for the device: the reduced values are copied to host memory
asynchronously behind an event, read when the step's result is collected (runner._resolve).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.worker.plan import PromptLogprob
from services.worker.sampling import to_device

SLICE_ROWS = 256   # rows of logits alive at once: [256, V] float32 = 128 MiB at V = 128k


@dataclass(slots=True)
class PromptSpan:
    """The rows of one request in one step that score prompt tokens."""

    request_id: str
    first_row: int            # its first scoring row among the step's flattened tokens
    first_position: int       # that row's position: it scores the token at first_position + 1
    targets: list[int]        # the prompt tokens scored, in order (token_ids[p + 1] for each row p)
    k: int                    # top logprobs wanted per position


def span_of(request_id: str, token_ids: Sequence[int], start: int, end: int, row0: int,
            scored_end: int, k: int) -> PromptSpan | None:
    """The scoring rows of a request's chunk [start, end) whose first row is step row `row0`:
    positions p < scored_end (= prompt_len - 1) score token p + 1. None: no row does."""
    hi = min(end, scored_end)
    if hi <= start:
        return None
    return PromptSpan(request_id, row0, start, list(token_ids[start + 1:hi + 1]), k)


def reduce_rows(hidden: torch.Tensor, targets: torch.Tensor, k: int,
                logits_fn: Callable[[torch.Tensor], torch.Tensor],
                slice_rows: int = SLICE_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [R, H] (the scoring rows), targets [R] long -> (logprob [R] f32, rank [R] long,
    top logprobs [R, k] f32, top ids [R, k] long). logits_fn: [s, H] -> float32 logits [s, V]."""
    r, dev = hidden.shape[0], hidden.device
    lp_out = torch.empty(r, dtype=torch.float32, device=dev)
    rank_out = torch.empty(r, dtype=torch.long, device=dev)
    top_v = torch.empty(r, k, dtype=torch.float32, device=dev)
    top_i = torch.empty(r, k, dtype=torch.long, device=dev)
    for a in range(0, r, slice_rows):
        b = min(r, a + slice_rows)
        lp = torch.log_softmax(logits_fn(hidden[a:b]), dim=-1)          # [s, V]
        tgt = lp.gather(1, targets[a:b, None])                         # [s, 1]
        lp_out[a:b] = tgt[:, 0]
        # vLLM's rank: 1 + how many tokens are strictly more likely.
        rank_out[a:b] = (lp > tgt).sum(dim=-1) + 1
        if k:
            v, i = lp.topk(k, dim=-1)
            top_v[a:b], top_i[a:b] = v, i
        del lp, tgt
    return lp_out, rank_out, top_v, top_i


class PromptLogprobHandle:
    """One step's prompt logprobs, on their way to host memory."""

    def __init__(self, spans: list[PromptSpan], values: tuple[torch.Tensor, ...]) -> None:
        self.spans = spans
        cuda = values[0].device.type == "cuda"
        self._host = tuple(v.to("cpu", non_blocking=cuda) for v in values)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> dict[str, list[PromptLogprob]]:
        """request id -> its PromptLogprobs of this step, in position order (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        lps, ranks, top_v, top_i = (t.tolist() for t in self._host)
        out: dict[str, list[PromptLogprob]] = {}
        row = 0
        for sp in self.spans:
            k = sp.k
            out[sp.request_id] = [
                PromptLogprob(sp.first_position + 1 + j, tok, lps[row + j], ranks[row + j],
                              list(zip(top_i[row + j][:k], top_v[row + j][:k])))
                for j, tok in enumerate(sp.targets)]
            row += len(sp.targets)
        return out


def compute(hidden: torch.Tensor, spans: list[PromptSpan], logits_fn: Callable[[torch.Tensor], torch.Tensor],
            slice_rows: int = SLICE_ROWS) -> PromptLogprobHandle:
    """Enqueue the prompt logprobs of `spans` over a step's hidden states [T, H]."""
    dev = hidden.device
    rows = [sp.first_row + j for sp in spans for j in range(len(sp.targets))]
    targets = [t for sp in spans for t in sp.targets]
    picked = hidden.index_select(0, to_device(rows, torch.long, dev))                       # [R, H]
    values = reduce_rows(picked, to_device(targets, torch.long, dev), max(sp.k for sp in spans),
                         logits_fn, slice_rows)
    return PromptLogprobHandle(spans, values)
