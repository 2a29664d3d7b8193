"""The worker's sampler: greedy, temperature/top-k/top-p/min-p, seeds, logprobs, processors."""
from __future__ import annotations

import math

import pytest
import torch

from services.common import pb
from services.worker.sampling import SampleRow, SamplingConfig, sample
from services.common.sampling_rules import SamplingRuleError
from services.worker.wire import sampling_from_proto

V = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def row(tokens=(1, 2, 3), num_output=0, seed=0, **kw) -> SampleRow:
    return SampleRow(SamplingConfig(seed=seed, **kw), list(tokens), num_output, seed)


def test_greedy_is_argmax():
    x = logits_rows(6)
    out = sample(x.clone(), [row() for _ in range(6)])
    assert [o.token_id for o in out] == x.argmax(-1).tolist()


def test_top_k_one_equals_greedy_at_any_temperature():
    x = logits_rows(6, seed=1)
    out = sample(x.clone(), [row(temperature=1.5, top_k=1, seed=s) for s in range(6)])
    assert [o.token_id for o in out] == x.argmax(-1).tolist()


def test_same_seed_gives_same_tokens_alone_or_batched():
    x = logits_rows(1, seed=2)[0]
    cfg = dict(temperature=1.0, top_p=0.95)
    alone = [sample(x[None].clone(), [row(tokens=range(10 + i), seed=1234, **cfg)])[0].token_id
             for i in range(20)]
    others = logits_rows(5, seed=3)
    batched = []
    for i in range(20):
        batch = torch.cat([others[:2], x[None], others[2:]])
        rows = [row(temperature=0.7, seed=7), row(), row(tokens=range(10 + i), seed=1234, **cfg),
                row(temperature=1.0, seed=99), row(top_k=3, temperature=2.0, seed=5)]
        batched.append(sample(batch, rows)[2].token_id)
    assert alone == batched
    assert len(set(alone)) > 1, "20 draws at temperature 1 should not all be the same token"


def test_different_seeds_give_different_draws():
    x = torch.zeros(1, V)  # uniform
    draws = {sample(x.clone(), [row(temperature=1.0, seed=s)])[0].token_id for s in range(30)}
    assert len(draws) > 10


def test_top_p_restricts_support_to_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.1] + [0.0] * (V - 4))
    x = probs.clamp_min(1e-12).log()[None]
    draws = {sample(x.clone(), [row(temperature=1.0, top_p=0.7, seed=s)])[0].token_id
             for s in range(200)}
    assert draws == {0, 1}


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.6, 0.3, 0.05, 0.05] + [0.0] * (V - 4))
    x = probs.clamp_min(1e-12).log()[None]
    draws = {sample(x.clone(), [row(temperature=1.0, min_p=0.2, seed=s)])[0].token_id
             for s in range(200)}
    assert draws == {0, 1}


def test_logprobs_are_log_softmax_of_raw_logits():
    x = logits_rows(3, seed=4)
    rows = [row(logprobs=5), row(temperature=1.0, seed=3, logprobs=0), row()]
    out = sample(x.clone(), rows)
    ref = torch.log_softmax(x, dim=-1)
    for i in (0, 1):
        assert math.isclose(out[i].logprob, ref[i, out[i].token_id].item(), abs_tol=1e-6)
    top = out[0].top
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert all(math.isclose(lp, ref[0, t].item(), abs_tol=1e-6) for t, lp in top)
    assert out[1].top == []
    assert out[2].logprob is None and out[2].top is None


def test_logit_bias_and_min_tokens_steer_greedy():
    x = logits_rows(1, seed=5)
    best = x.argmax().item()
    target = (best + 1) % V
    out = sample(x.clone(), [row(logit_bias=((target, 100.0),))])
    assert out[0].token_id == target
    # min_tokens: the EOS id (the argmax here) is masked while fewer outputs than min_tokens.
    masked = sample(x.clone(), [row(min_tokens=2, num_output=1)], eos_token_ids=(best,))
    assert masked[0].token_id != best
    free = sample(x.clone(), [row(min_tokens=2, num_output=2)], eos_token_ids=(best,))
    assert free[0].token_id == best


def test_penalties_push_away_from_repeated_tokens():
    x = torch.zeros(1, V)
    x[0, 7], x[0, 8] = 2.0, 1.9
    assert sample(x.clone(), [row(tokens=(7, 7), num_output=2)])[0].token_id == 7
    assert sample(x.clone(), [row(tokens=(7,), num_output=1, repetition_penalty=1.2)])[0].token_id == 8
    assert sample(x.clone(), [row(tokens=(7,), num_output=1, presence_penalty=0.5)])[0].token_id == 8
    assert sample(x.clone(), [row(tokens=(7, 7), num_output=2, frequency_penalty=0.1)])[0].token_id == 8
    # frequency/presence only count outputs: 7 in the prompt alone is not penalised
    assert sample(x.clone(), [row(tokens=(7, 5), num_output=1, presence_penalty=0.5)])[0].token_id == 7


def test_sampling_params_from_proto_apply_defaults_and_reject_nonsense():
    cfg = sampling_from_proto(pb.common.SamplingParams(), V)
    assert cfg.greedy and cfg.top_p == 1.0 and cfg.repetition_penalty == 1.0 and cfg.logprobs is None
    cfg = sampling_from_proto(pb.common.SamplingParams(logprobs=0, seed=0), V)
    assert cfg.logprobs == 0 and cfg.seed == 0
    assert sampling_from_proto(pb.common.SamplingParams(logprobs=1000), V).logprobs == 20
    for bad in (dict(temperature=-1.0), dict(top_p=1.5), dict(temperature=float("nan")),
                dict(logit_bias={V + 3: 1.0})):
        with pytest.raises(SamplingRuleError):
            sampling_from_proto(pb.common.SamplingParams(**bad), V)


def test_bf16_logits_of_a_decode_graph_sample_as_their_float32_widening():
    """Decode graphs hand the sampler bf16 logits: plain greedy rows take their argmax as is; any
    row that needs more (a bias, logprobs) makes the whole batch run on the exact float32 copy."""
    x = torch.zeros(3, V, dtype=torch.bfloat16)
    x[:, 3] = x[:, 4] = 1.0                       # a tie: argmax takes the first
    x[2, 9] = 2.5
    plain = sample(x.clone(), [row() for _ in range(3)])
    assert [o.token_id for o in plain] == [3, 3, 9]
    # +0.001 vanishes in bf16 (1.0 + 0.001 rounds to 1.0); in float32 it breaks the tie.
    before = x.clone()
    biased = sample(x, [row(), row(logit_bias=((4, 0.001),)), row(logprobs=1)])
    assert [o.token_id for o in biased] == [3, 4, 9]
    assert torch.equal(x, before), "the graph's own logits are not modified"
    want = torch.log_softmax(x[2].float(), dim=-1)
    assert biased[2].logprob == pytest.approx(want[9].item(), abs=1e-6)
    assert biased[2].top[0][0] == 9
