"""The sampler on CUDA logits: every feature runs on the device, and a seeded request samples the
same tokens alone or inside any batch (its noise comes from its own generator only)."""
from __future__ import annotations

import torch

from services.common import pb
from services.worker.sampling import SampleRow, SamplingConfig, sample
from services.worker.wire import sampling_from_proto

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_seeded_sampling_on_cuda_is_batch_invariant_with_every_feature():
    v = 4096
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(6, v, device=DEV, generator=g) * 3
    sp = pb.common.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, presence_penalty=0.5,
                                  frequency_penalty=0.3, repetition_penalty=1.2, seed=1234, logprobs=3,
                                  logit_bias={7: 5.0})
    cfg = sampling_from_proto(sp, v)
    others = [SamplingConfig(), SamplingConfig(temperature=1.0, seed=9), SamplingConfig(temperature=0.5, top_k=5)]
    history = [3, 7, 7, 100, 2000]
    target = SampleRow(cfg, history, 3, cfg.seed)
    alone = sample(logits[2:3].clone(), [target])[0]
    rows = [SampleRow(others[i % 3], history, 2, 100 + i) for i in range(6)]
    rows[2] = target
    batched = sample(logits.clone(), rows)[2]
    assert alone.token_id == batched.token_id
    assert abs(alone.logprob - batched.logprob) < 1e-4
    assert [t for t, _ in alone.top] == [t for t, _ in batched.top]
