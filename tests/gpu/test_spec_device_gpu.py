"""Device-fed speculative steps on CUDA (spec/device_steps.py, gpu_fed.py): with two steps in
flight, n-gram drafts proposed on the device (and suffix chains proposed on the host) replay the
verify (and decode) CUDA graphs with positions, slots and context lengths written on the device,
and the tokens (greedy and seeded) are plain decoding's (float32, so batch shapes cannot flip a near-tie; logprobs within TF32)."""
from __future__ import annotations

import pytest
import torch

from services.common import pb
from services.common.spec_config import parse_spec_config
from services.worker.models import load_model
from tests.overlap_driver import run
from tests.unit.tiny_llama import VOCAB, make_tiny_llama

NGRAM = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3, "dynamic_k": [[1, 64, 4]]})


def repetitive(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [((torch.randint(4, VOCAB, (3 + i % 3,), generator=g).tolist()) * 4)[: 8 + i] for i in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-fed-gpu"), seed=7), "cuda", torch.float32)


def test_device_fed_steps_replay_graphs_and_give_plain_decodings_tokens(model, monkeypatch):
    import services.worker.gpu_fed as gpu_fed
    eager = []
    orig = gpu_fed.compute_logits_triton
    monkeypatch.setattr(gpu_fed, "compute_logits_triton", lambda *a, **k: eager.append(1) or orig(*a, **k))
    ps = repetitive(6)
    sps = [pb.common.SamplingParams(ignore_eos=True, logprobs=1)] * 3 + [
        pb.common.SamplingParams(temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(3)]
    want, want_lp, _, _ = run(model, ps, sps, overlap=True, new_tokens=32)
    got, got_lp, s, depth = run(model, ps, sps, overlap=True, new_tokens=32, spec=NGRAM)
    assert got == want
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=5e-3)   # TF32 dots of other shapes
    d = s.runner.spec
    assert d.fed_steps > 0 and d.drafted > 0 and depth == 2
    assert not eager, "every device-fed step replayed a captured graph"


def test_suffix_chains_fed_from_the_device_replay_graphs_and_give_plain_decodings_tokens(model, monkeypatch):
    """Suffix decoding's host chains (spec/device_chains.py) through the feed kernel and the verify
    graphs: three at a time, the last three repeating the first three (greedy and seeded, so their
    outputs repeat and the shared store of finished outputs gives their chains)."""
    monkeypatch.setenv("MESHLLM_DEVICE_CHAINS", "1")
    import services.worker.gpu_fed as gpu_fed
    eager = []
    orig = gpu_fed.compute_logits_triton
    monkeypatch.setattr(gpu_fed, "compute_logits_triton", lambda *a, **k: eager.append(1) or orig(*a, **k))
    suffix = parse_spec_config({"method": "suffix", "num_speculative_tokens": 4, "dynamic_k": [[1, 64, 4]]})
    ps = repetitive(3) * 2
    sps = [pb.common.SamplingParams(ignore_eos=True, logprobs=1),
           pb.common.SamplingParams(temperature=0.8, seed=5, ignore_eos=True),
           pb.common.SamplingParams(ignore_eos=True)] * 2
    want, want_lp, _, _ = run(model, ps, sps, overlap=True, new_tokens=32, max_seqs=3)
    got, got_lp, s, depth = run(model, ps, sps, overlap=True, new_tokens=32, max_seqs=3, spec=suffix)
    assert got == want
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=5e-3)
    d = s.runner.spec
    assert d.fed_steps > 0 and d.accepted > 0 and depth == 2
    assert not eager, "every device-fed step replayed a captured graph"


def test_draft_model_chains_fed_from_the_device_give_plain_decodings_tokens(model, monkeypatch, tmp_path):
    """The draft model (the tiny model drafting for itself, its own executor and graphs) drafts its
    chains on the device before each step's forward; nothing waits for the step before."""
    monkeypatch.setenv("MESHLLM_DEVICE_CHAINS", "1")
    import services.worker.gpu_fed as gpu_fed
    eager = []
    orig = gpu_fed.compute_logits_triton
    monkeypatch.setattr(gpu_fed, "compute_logits_triton", lambda *a, **k: eager.append(1) or orig(*a, **k))
    draft = parse_spec_config({"method": "draft_model", "num_speculative_tokens": 4, "model": str(tmp_path),
                               "dynamic_k": [[1, 64, 4]]})
    ps = repetitive(4)
    sps = [pb.common.SamplingParams(ignore_eos=True, logprobs=1)] * 2 + [
        pb.common.SamplingParams(temperature=0.8, seed=9 + i, ignore_eos=True) for i in range(2)]
    want, want_lp, _, _ = run(model, ps, sps, overlap=True, new_tokens=32)
    got, got_lp, s, depth = run(model, ps, sps, overlap=True, new_tokens=32, spec=draft, draft_model=model)
    assert got == want
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=5e-3)
    d = s.runner.spec
    assert d.fed_steps > 0 and d.accepted > 0 and depth == 2
    assert d.accepted / d.drafted > 0.5, (d.drafted, d.accepted)
    assert not eager, "every device-fed step replayed a captured graph"
