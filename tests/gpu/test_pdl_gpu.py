"""Programmatic dependent launch (kernels/pdl.py) on the GPU: one-row launches use it, wider ones
do not, and a batch-1 decode through the CUDA graphs gives the same tokens and top-2 logits with
it as without it."""
from __future__ import annotations

import pytest
import torch

from services.worker.kernels import pdl
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.gpu.greedy_driver import greedy_with_top2
from tests.unit.tiny_llama import make_tiny_llama


def test_only_launches_of_one_row_use_it_on_hopper():
    assert torch.cuda.get_device_capability()[0] >= 9
    assert pdl.launch_args(torch.zeros(1, 8, device="cuda")) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_args(torch.zeros(2, 8, device="cuda")) == {"USE_PDL": False}


def test_a_batch_1_decode_gives_the_same_tokens_and_logits_with_and_without_it(tmp_path, monkeypatch):
    model = load_model(make_tiny_llama(tmp_path, seed=3), "cuda", torch.bfloat16)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", on)   # before the runner captures its graphs
        runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=64, block_size=16)
        runs.append(greedy_with_top2(ProtoRunner(runner), [[5, 9, 11, 40, 7, 3, 22, 61, 17]], 24, pipelined=True))
        del runner
    (tok_on, top_on), (tok_off, top_off) = runs
    assert tok_on == tok_off and top_on == top_off
    assert len(tok_on[0]) == 24
