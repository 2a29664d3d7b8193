"""Exact verification of drafts (services/worker/spec/verify.py).

Point-mass drafts: sampling every verified position with the ordinary sampler and keeping the
prefix that matches gives exactly the non-speculative tokens. Distribution drafts (rejection
sampling): over many draws on a small vocabulary, the first emitted token and the first two
emitted tokens jointly follow the target's distribution (chi-square), and a deliberately wrong
acceptance rule (one that believes the drafts came from another distribution) is caught."""
from __future__ import annotations

import torch

from services.worker.plan import SamplingConfig
from services.worker.sampling import SampleRow, sample
from services.worker.spec.verify import accept_point_drafts, rejection_sample

V = 6
N = 40_000


def test_point_drafts_keep_the_matching_prefix_and_emit_the_first_mismatch():
    sampled = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [4, 4, 4, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [4, 4, 0]])
    accepted = accept_point_drafts(sampled, drafts, torch.tensor([3, 3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0, 2]        # the last row: only 2 drafts were proposed


def test_point_draft_verification_reproduces_the_plain_seeded_sampler():
    """Each position samples with its own seed: the tokens a speculative step emits are the ones
    plain decoding draws, one step at a time, for any draft (right or wrong)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 32)                      # positions 10..14 of one request
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, seed=1234)
    rows = [SampleRow(cfg, list(range(10 + i)), i, 77, position=10 + i) for i in range(5)]
    plain = [t.token_id for t in sample(logits.clone(), rows)]
    for drafts in (plain[:4], [plain[0], (plain[1] + 1) % 32, 0, 0], [(plain[0] + 3) % 32, 1, 2, 3]):
        a = int(accept_point_drafts(torch.tensor([plain]), torch.tensor([drafts]), torch.tensor([4]))[0])
        emitted = (drafts[:a] + [plain[a]])
        assert emitted == plain[:a + 1]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 5
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def _simulate(wrong_q: bool = False, seed: int = 0):
    """Two drafts per row from a draft model q; the target p at each position depends on the
    tokens before it. -> (first emitted tokens, second emitted tokens where 2+ were emitted, p1, p2)."""
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, 1)            # p2[t1]
    p3 = torch.softmax(torch.randn(V, V, V, generator=g), 2)               # p3[t1, t2]
    q1 = torch.softmax(torch.randn(V, generator=g), 0)
    q2 = torch.softmax(torch.randn(V, V, generator=g), 1)
    d1 = torch.multinomial(q1, N, replacement=True, generator=g)
    d2 = torch.multinomial(q2[d1], 1, generator=g)[:, 0]
    drafts = torch.stack([d1, d2], 1)
    target = torch.stack([p1.expand(N, V), p2[d1], p3[d1, d2]], 1)         # [N, 3, V]
    draft_probs = torch.stack([q1.expand(N, V), q2[d1]], 1)                 # [N, 2, V]
    if wrong_q:   # the verifier believes the drafts were uniform
        draft_probs = torch.full_like(draft_probs, 1.0 / V)
    uniforms = torch.rand(N, 2, generator=g)
    noise = torch.empty(N, 3, V).exponential_(generator=g)
    tokens, accepted = rejection_sample(target, draft_probs, drafts, torch.full((N,), 2), uniforms, noise)
    return tokens, accepted, p1, p2


def _first_two(tokens, accepted, p2, seed=9):
    """The first two output tokens: both from this step where it emitted two or more, else the
    second from the next (plain) step, which samples p2[t1]."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.multinomial(p2[tokens[:, 0]], 1, generator=g)[:, 0]
    return tokens[:, 0], torch.where(accepted >= 1, tokens[:, 1], nxt)


def test_rejection_sampling_gives_the_target_distribution_and_a_wrong_rule_is_caught():
    tokens, accepted, p1, p2 = _simulate()
    t1, t2 = _first_two(tokens, accepted, p2)
    # df = 5 and 35: P(chi2 > 25) and P(chi2 > 75) are both about 1e-4.
    assert _chi2(torch.bincount(t1, minlength=V).double(), p1.double()) < 25, "first token ~ p1"
    joint = torch.bincount(t1 * V + t2, minlength=V * V).double()
    assert _chi2(joint, (p1[:, None] * p2).flatten().double()) < 75, "(t1, t2) ~ p1(t1) p2(t2 | t1)"
    assert 0.2 * N < int((accepted >= 1).sum()) < N, "some drafts accepted, some rejected"

    bad, bad_accepted, p1, p2 = _simulate(wrong_q=True)
    b1, b2 = _first_two(bad, bad_accepted, p2)
    assert _chi2(torch.bincount(b1, minlength=V).double(), p1.double()) > 100, \
        "believing the wrong q must bias the output (the test can fail)"


def test_rejection_sampling_with_equal_distributions_accepts_everything():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, V, generator=g), 1)
    target = torch.stack([p, p, p], 1)
    drafts = torch.multinomial(p, 2, replacement=True, generator=g)
    tokens, accepted = rejection_sample(target, target[:, :2], drafts, torch.full((4,), 2),
                                        torch.rand(4, 2, generator=g), torch.empty(4, 3, V).exponential_(generator=g))
    assert accepted.tolist() == [2, 2, 2, 2]
    assert torch.equal(tokens[:, :2], drafts)
