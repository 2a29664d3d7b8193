"""N-gram prompt lookup on the device, so that a step can draft without the previous step's
tokens reaching the host (device_steps.py: the step is planned before the previous one's
acceptance is known; the device feeds the accepted count forward).

Each request that drafts this way holds a row of `hist` (its tokens on the device) and its length
`hlen`. A device-fed step's verify results are appended there on the device (`commit`: the
accepted drafts and the token after them), so the next step reads its input token, positions and
proposals from the device. Rows are filled from the host when a request starts drafting this way
(`sync`: the host's tokens not written yet, plus a pending token straight from the sampler's
device buffer).

The proposal is the host proposer's (ngram.py): the continuation of the most recent earlier
occurrence of the longest suffix n-gram, n from prompt_lookup_max down to prompt_lookup_min, up
to k tokens; here for every row at once with a fixed number of tensor ops. For every end e of a
possible match, the match length of the request's suffix ending at e is the run of equal tokens
walking back from e (windows of n_max tokens, compared at once); the best e has the longest run
(at most n_max, at least n_min) and, among those, is the latest one with a continuation."""
from __future__ import annotations

import torch

PAD = -2          # left padding of every row: equal to no token, so no match reaches before index 0
NO_DRAFT = -1     # a draft slot with nothing proposed (never equal to a sampled token)


class DeviceNgram:
    def __init__(self, n_min: int, n_max: int, max_len: int, max_width: int, num_slots: int,
                 device: torch.device) -> None:
        """max_len: the most tokens a request has; max_width: the most tokens one step appends
        (1 + the most drafts); num_slots: requests with a device row at once."""
        self.n_min, self.n_max = n_min, n_max
        self.lead = n_max            # PAD columns before a row's first token
        self.max_len = max_len
        self.width = self.lead + max_len + max_width + 1
        self.device = device
        self.hist = torch.full((num_slots, self.width), PAD, dtype=torch.int32, device=device)
        self.hlen = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self.slot: dict[str, int] = {}
        self.synced: dict[str, int] = {}    # request id -> host tokens already in its row

    # ---- rows -------------------------------------------------------------------------------
    def assign(self, request_id: str) -> int | None:
        """The request's row (a new one if it had none), or None when every row is taken."""
        s = self.slot.get(request_id)
        if s is None and self._free:
            s = self._free.pop()
            self.slot[request_id] = s
            self.synced[request_id] = 0
        return s

    def release(self, request_id: str) -> None:
        s = self.slot.pop(request_id, None)
        if s is not None:
            self.synced.pop(request_id, None)
            self._free.append(s)

    def clear(self) -> None:
        for rid in list(self.slot):
            self.release(rid)

    def sync(self, rows: list[tuple[str, list[int], int]], prev_tokens: torch.Tensor) -> None:
        """Bring rows up to the host: (request id, its host tokens, the row of prev_tokens holding
        its pending token, or -1 when it has none). Tokens already written are not sent again
        (a request's tokens only grow; a preempted one starts again as a new request)."""
        if not rows:
            return
        cols, vals, slots, lens, pend_slot, pend_col, pend_src = [], [], [], [], [], [], []
        for rid, tokens, pending_row in rows:
            s = self.slot[rid]
            done = self.synced[rid]
            cols.extend(range(self.lead + done, self.lead + len(tokens)))
            vals.extend(tokens[done:])
            slots.extend([s] * (len(tokens) - done))
            self.synced[rid] = len(tokens)
            n = len(tokens)
            if pending_row >= 0:
                pend_slot.append(s)
                pend_col.append(self.lead + n)
                pend_src.append(pending_row)
                n += 1
            lens.append((s, n))
        dev = self.device
        if vals:
            self.hist.index_put_((_up(slots, dev), _up(cols, dev)), _up(vals, dev).to(torch.int32))
        if pend_slot:
            self.hist.index_put_((_up(pend_slot, dev), _up(pend_col, dev)),
                                 prev_tokens.index_select(0, _up(pend_src, dev)).to(torch.int32))
        self.hlen.index_put_((_up([s for s, _ in lens], dev),), _up([n for _, n in lens], dev))

    # ---- per step ---------------------------------------------------------------------------
    def propose(self, slots: torch.Tensor, ks: torch.Tensor, k_max: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [n]: the rows; ks [n]: drafts wanted per row (<= k_max); span: an upper bound
        of the rows' lengths -> (drafts [n, k_max] long, NO_DRAFT where none; lengths [n])."""
        n_max, lead = self.n_max, self.lead
        span = min(span, self.width - lead)
        length = self.hlen.index_select(0, slots)                                   # [n]
        h = self.hist.index_select(0, slots)[:, :lead + span].long()               # [n, lead + span]
        ar_n = torch.arange(n_max, device=h.device)
        # The suffix, last token first: suf[:, t] = token at length - 1 - t (PAD before the start).
        suf = h.gather(1, lead + length[:, None] - 1 - ar_n)                       # [n, n_max]
        # windows[:, e, t] = token at e - t for every possible match end e in [0, span).
        win = h.unfold(1, n_max, 1)[:, 1:span + 1].flip(-1)                         # [n, span, n_max]
        run = (win == suf[:, None, :]).long().cumprod(-1).sum(-1)                   # [n, span]
        ar_e = torch.arange(span, device=h.device)
        # A match needs a continuation (e <= length - 2) and at least n_min tokens.
        ok = (ar_e[None, :] <= length[:, None] - 2) & (run >= self.n_min)
        score = torch.where(ok, run * span + ar_e[None, :], -1)
        best = score.max(-1).values                                                # [n]
        found = best >= 0
        cont = (best % span + 1)[:, None] + torch.arange(k_max, device=h.device)[None, :]   # [n, k_max]
        valid = found[:, None] & (cont < length[:, None]) & (torch.arange(k_max, device=h.device)[None, :] < ks[:, None])
        drafts = torch.where(valid, h.gather(1, (lead + cont).clamp(max=lead + span - 1)), NO_DRAFT)
        return drafts, length

    def inputs(self, slots: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """The token each row runs first: its last token (the one the last step sampled) -> [n]."""
        return self.hist[slots, self.lead + length - 1].long()

    def commit(self, slots: torch.Tensor, drafts: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """After a device-fed step: sampled [n, q] (q = k_max + 1) at each row's verified positions,
        drafts [n, q - 1] -> accepted drafts per row [n]; the accepted drafts and the token after
        them are appended to the rows (everything past the new length is scratch)."""
        n, q = sampled.shape
        acc = (sampled[:, :q - 1] == drafts).long().cumprod(-1).sum(-1) if q > 1 else torch.zeros(
            n, dtype=torch.long, device=sampled.device)
        length = self.hlen.index_select(0, slots)
        # A request past max_len is finished (the scheduler drops what a step in flight ran there).
        cols = (self.lead + length[:, None] + torch.arange(q, device=sampled.device)[None, :]).clamp_(max=self.width - 1)
        self.hist.index_put_((slots[:, None].expand(n, q), cols), sampled.to(torch.int32))
        self.hlen.index_copy_(0, slots, (length + acc + 1).clamp_(max=self.max_len + 1))
        return acc


def _up(values: list[int], device: torch.device) -> torch.Tensor:
    from services.worker.sampling import to_device
    return to_device(values, torch.long, device)
