"""Proposals made past the step in flight and checked on the device (suffix decoding, and the draft
model): the suffix proposer runs on the host while the device still runs the step before, the
draft model drafts on the device in stream order before the step's forward, and the step is
launched without reading the one before.

When a device-fed step N + 1 is built, the host has read every step up to N - 1; step N is in
flight and may emit up to `unknown` tokens (1, or 1 + its drafts). The suffix proposer walks on
from the tokens the host has: its guess of step N's tokens, then the drafts after them, as one
chain of at most `chain_len` = 2K + 1 tokens, anchored at the host's token count. On the device
(kernels/spec_fed.feed, or `propose` here on a CPU) the row's real tokens past the anchor (what
step N emitted, appended behind its sampler: DeviceNgram's rows) are compared with the chain's
head: where they are equal, the chain's next tokens are the row's drafts; where not (step N
rejected a draft, or the guess of its bonus token was wrong), or where the chain has nothing after
them, the row's drafts are the n-gram search's over its own tokens on the device (device_ngram.py,
`prompt_lookup_min/max`): after a rejection the text usually goes on as before the draft went
wrong, and that search finds it. Verification does not care where drafts come from
(point-mass proposals, spec/verify.py), so tokens stay exactly plain decoding's.

The draft model's chain is its greedy continuation from the host's tokens (its KV caught up on
them: positions the host knows), kept on the device; the host reads it with the next step, to
keep the draft KV of the tokens that turned out right (draft_model.DraftModel.propose_chains).

The hit rate the width choice reads (acceptance.found) counts such misses like empty proposals:
a request whose chains keep breaking stops paying for drafts it never gets."""
from __future__ import annotations

import torch

from services.worker.spec.device_ngram import NO_DRAFT, DeviceNgram


class DeviceChains(DeviceNgram):
    def __init__(self, k_max: int, n_min: int, n_max: int, max_len: int, max_width: int, num_slots: int,
                 device: torch.device) -> None:
        """n_min, n_max: the n-gram search a row falls back to where its chain broke."""
        super().__init__(n_min, n_max, max_len, max_width, num_slots, device)
        self.chain_len = 2 * k_max + 1      # step N's tokens (<= K + 1), then K drafts

    def host_chains(self, spec, scheduled, ks: list[int]) -> list[int]:
        """Per row of a device-fed step (runner._Scheduled, drafts allowed): its anchor (the tokens
        the host has read) and its chain, NO_DRAFT-padded to chain_len -> [n * (chain_len + 1)]
        flat, row after row (the feed's `chains`)."""
        out: list[int] = []
        pad = [NO_DRAFT] * self.chain_len
        for s, k in zip(scheduled, ks):
            st = s.state
            prop = spec.proposers.get(st.request_id) if k else None
            # The step in flight emits its one token plus at most its drafts (dev_slack).
            unknown = st.num_pending + (st.dev_slack if st.num_pending else 0)
            chain = prop.propose(min(self.chain_len, unknown + k)) if prop is not None else []
            out.append(len(st.token_ids))
            out.extend(chain)
            out.extend(pad[len(chain):])
        return out

    def draft_chains(self, draft, scheduled, ks: list[int]) -> torch.Tensor:
        """The draft model's chains (spec/draft_model.DraftModel.propose_chains): its greedy
        continuation of the tokens the host has, drafted on the device in this step's stream
        order before the forward, never read here -> [n, chain_len + 1] long on the device."""
        from services.worker.sampling import to_device
        rows, anchors = [], []
        for s, k in zip(scheduled, ks):
            st = s.state
            unknown = st.num_pending + (st.dev_slack if st.num_pending else 0)
            rows.append((st.request_id, min(self.chain_len, unknown + k) if k else 0))
            anchors.append(len(st.token_ids))
        toks = draft.propose_chains(rows, self.chain_len)                         # [n, chain_len]
        return torch.cat([to_device(anchors, torch.long, toks.device)[:, None], toks], 1).contiguous()

    def propose(self, slots: torch.Tensor, ks: torch.Tensor, k_max: int, span: int,
                chains: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The feed's torch twin: chains [n, chain_len + 1] (anchor, then the chain) -> (drafts
        [n, k_max] long, NO_DRAFT where none; lengths [n])."""
        fallback, length = super().propose(slots, ks, k_max, span)                # the n-gram search
        ch = self.chain_len
        if chains is None or k_max <= 0:
            return fallback, length
        anchor, chain = chains[:, 0], chains[:, 1:]                                # [n], [n, ch]
        m = length - anchor                                                        # tokens emitted since
        c = torch.arange(ch, device=slots.device)
        cols = (self.lead + anchor[:, None] + c[None, :]).clamp(max=self.width - 1)
        seen = self.hist[slots[:, None], cols].long()                              # [n, ch]
        broken = ((c[None, :] < m[:, None]) & (seen != chain)).any(1) | (m > ch)
        j = torch.arange(k_max, device=slots.device)
        idx = m[:, None] + j[None, :]                                              # [n, k_max]
        valid = ~broken[:, None] & (j[None, :] < ks[:, None]) & (idx < ch)
        drafts = torch.where(valid, chain.gather(1, idx.clamp(max=ch - 1)), NO_DRAFT)
        held = drafts[:, 0] != NO_DRAFT                                            # a draft after the head
        return torch.where(held[:, None], drafts, fallback), length
