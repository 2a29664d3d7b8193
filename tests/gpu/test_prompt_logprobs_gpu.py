"""Prompt logprobs on CUDA (the GPU executor's eager prefill with Triton kernels, decode graphs
captured): the values of the CPU reference path at several chunk sizes, and a long prompt whose
whole [L, V] logits would be hundreds of MiB never allocates more than a slice of them."""
from __future__ import annotations

import pytest
import torch

from services.worker.models import load_model
from services.worker.runner import ModelRunner
from tests.prompt_logprobs_driver import run_chunked
from tests.unit.tiny_llama import VOCAB, make_tiny_llama


# The Triton forward's fp32 dots run in TF32 (tl.dot's default): on this random model (weights
# scaled up, so logits spread over ~10 nats) its logprobs differ from the CPU's by up to ~1.5e-2.
TOL = 3e-2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-plp-gpu"), seed=5)


@pytest.mark.parametrize("chunk", [3, 16, 64])
def test_cuda_prompt_logprobs_equal_the_cpu_reference(tiny_dir, chunk):
    g = torch.Generator().manual_seed(chunk)
    prompts = {f"r{i}": torch.randint(4, VOCAB, (n,), generator=g).tolist() for i, n in enumerate((41, 17, 2))}
    got = []
    for device in ("cpu", "cuda"):
        model = load_model(tiny_dir, device, torch.float32)
        runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=64, block_size=16)
        runner.hello(16)
        assert (runner.gpu is not None) == (device == "cuda")
        got.append(run_chunked(runner, prompts, chunk, k=4))
    (ref, ref_first), (cuda, cuda_first) = got
    assert cuda_first == ref_first
    for rid, p in prompts.items():
        assert [lp.position for lp in cuda[rid]] == list(range(1, len(p)))
        assert [lp.token_id for lp in cuda[rid]] == [lp.token_id for lp in ref[rid]]
        assert [lp.logprob for lp in cuda[rid]] == pytest.approx([lp.logprob for lp in ref[rid]], abs=TOL)
        for a, b in zip(cuda[rid], ref[rid]):
            # a near-tie in the top k may swap (order, or the k-th id), never the values
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=TOL)
            ref_top = {t.token_id: t.logprob for t in b.top}
            assert all(t.logprob == pytest.approx(ref_top[t.token_id], abs=TOL)
                       for t in a.top if t.token_id in ref_top)
            assert sum(t.token_id in ref_top for t in a.top) >= len(a.top) - 1
            assert abs(a.rank - b.rank) <= 3


def test_a_long_prompt_on_cuda_allocates_a_slice_of_logits_not_all_of_them(tmp_path):
    vocab, length = 49152, 4096     # whole logits: 4096 x 49152 x 4 B = 768 MiB
    model = load_model(make_tiny_llama(tmp_path, seed=2, vocab=vocab, max_pos=8192), "cuda", torch.bfloat16)
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=300, block_size=16)
    runner.hello(16)
    p = torch.randint(4, vocab, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    run_chunked(runner, {"warm": p[:600]}, 600, k=5)    # kernels compiled, allocator settled
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got, _ = run_chunked(runner, {"long": p}, length, k=5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert [lp.position for lp in got["long"]] == list(range(1, length))
    assert peak < 256 * 2**20, f"peak {peak / 2**20:.0f} MiB: whole-prompt logits would be 768 MiB"
    print(f"long prompt: {length} tokens, peak extra memory {peak / 2**20:.0f} MiB")
