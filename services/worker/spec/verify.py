"""Exact verification of draft tokens, on the logits' device, without a host sync.

Point-mass drafts (n-gram and suffix proposals: the proposer puts all its probability on one
token) need no acceptance coin: sample every verified position with the ordinary sampler (the
target's processed distribution, the request's own per-position seed) and accept the longest
prefix of drafts that equals what was sampled; the first mismatching sample (or the sample after
the last draft: the bonus token) is emitted too. That is rejection sampling with q = delta(d):
P(accept d) = p(d), and a rejected position emits p conditioned on "not d" — the residual
max(0, p - q) normalised. Because each position's draw uses the seed of its position, the
emitted tokens are exactly those the non-speculative sampler would have drawn: greedy and seeded
outputs (and their logprobs) are identical with speculation on and off.

Distribution drafts (a draft model with probabilities q): the standard rule (Leviathan et al.,
Chen et al.): accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
emit a sample of max(0, p_i - q_i) normalised; if every draft is accepted, a bonus sample of the
next position's p. The output distribution is the target's."""
from __future__ import annotations

import torch


def accept_point_drafts(sampled: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """sampled [R, K+1] (the sampler's tokens at each verified position), drafts [R, K] (any
    value past a row's count), num_drafts [R] -> accepted [R]: the leading drafts equal to the
    samples. The row emits sampled[r, :accepted[r] + 1]."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros(sampled.shape[0], dtype=torch.long, device=sampled.device)
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (sampled[:, :k] == drafts) & valid
    return torch.cumprod(match.to(torch.int32), dim=1).sum(dim=1).to(torch.long)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                     num_drafts: torch.Tensor, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify distribution drafts.

    target_probs [R, K+1, V]: the target's processed distribution at each position (position i
    conditioned on drafts[:, :i]); draft_probs [R, K, V]: the draft model's, from which drafts
    [R, K] were drawn; num_drafts [R] <= K; uniforms [R, K] in [0, 1) (the acceptance coins);
    noise [R, K+1, V] > 0, Exp(1) draws (argmax p / noise samples p: the same exponential race
    as sampling.py). -> (tokens [R, K+1], accepted [R]); a row emits tokens[r, :accepted[r] + 1].
    All on the tensors' device; no host sync."""
    r, k1, _ = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    rows = torch.arange(r, device=dev)
    if k:
        idx = drafts.clamp(min=0)[:, :, None]
        p_d = target_probs[:, :k].gather(2, idx)[:, :, 0]
        q_d = draft_probs.gather(2, idx)[:, :, 0]
        ratio = torch.where(q_d > 0, p_d / q_d.clamp(min=1e-30), torch.zeros_like(p_d))
        valid = torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
        ok = (uniforms < ratio.clamp(max=1.0)) & valid
        accepted = torch.cumprod(ok.to(torch.int32), dim=1).sum(dim=1).to(torch.long)
    else:
        accepted = torch.zeros(r, dtype=torch.long, device=dev)
    # The emitted distribution at position `accepted`: the residual where a draft was rejected,
    # the target's own where every draft was accepted (the bonus position).
    p_at = target_probs[rows, accepted]                                         # [R, V]
    if k:
        rejected = accepted < num_drafts
        q_at = draft_probs[rows, accepted.clamp(max=k - 1)]
        residual = (p_at - q_at).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q exactly leaves no residual (and was then never rejected): fall back to p.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
        dist = torch.where(rejected[:, None], residual, p_at)
    else:
        dist = p_at
    last = (dist / noise[rows, accepted].clamp(min=1e-30)).argmax(dim=1)
    tokens = torch.zeros(r, k1, dtype=torch.long, device=dev)
    if k:
        tokens[:, :k] = drafts.clamp(min=0)
    tokens[rows, accepted] = last
    return tokens, accepted
