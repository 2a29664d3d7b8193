"""Host/GPU overlap on CUDA (Triton kernels, CUDA graphs, the embedding kernel reading pending ids
from the sampler's device buffer): driven by the scheduler core with two plans in flight, the
pipelined runner gives exactly the tokens of the same plans run with every step's tokens read at
once, for greedy, seeded, penalised and logprob requests, through preemption too."""
from __future__ import annotations

import pytest
import torch

from services.worker.models import load_model
from tests.overlap_driver import prompts, run, sampling_mix
from tests.unit.tiny_llama import VOCAB, make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-overlap-gpu"), seed=5), "cuda", torch.bfloat16)


@pytest.mark.parametrize("num_blocks", [64, 9])
def test_pipelined_runner_on_cuda_gives_the_unpipelined_tokens(model, num_blocks):
    ps = prompts(8, VOCAB)
    sps = [sampling_mix(i) for i in range(8)]
    want, want_lp, _, _ = run(model, ps, sps, overlap=False, depth=2, budget=16, num_blocks=num_blocks)
    got, got_lp, s, depth = run(model, ps, sps, overlap=True, depth=2, budget=16, num_blocks=num_blocks)
    assert got == want
    assert got_lp == want_lp
    assert depth == 2
    if num_blocks == 9:
        assert s.num_preemptions > 0
