"""Prompt logprobs in the worker (services/worker/prompt_logprobs.py), driven with protobuf plans
through the wire edge: equal to log_softmax of one plain full forward (transformers) whatever the
prefill chunking, position 0 has none, ranks and top-k are right, logits never exist for more than
a slice of rows at once."""
from __future__ import annotations

import os

import pytest
import torch

# The GPU executor's Triton path runs on the CPU under the interpreter (as in test_worker_kernels);
# set before any kernel module is imported (decorated).
os.environ.setdefault("TRITON_INTERPRET", "1")

from services.worker import prompt_logprobs
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from tests.prompt_logprobs_driver import run_chunked
from tests.unit.tiny_llama import VOCAB, hf_model, make_tiny_llama

BLOCK = 4
NUM_BLOCKS = 160


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-plp"), seed=5)


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return load_model(tiny_dir)


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """log_softmax over one full forward of the whole prompt: [L, V]; row j predicts token j+1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against(ref: torch.Tensor, prompt: list[int], lps: list, k: int, atol: float = 1e-4) -> None:
    assert [lp.position for lp in lps] == list(range(1, len(prompt)))   # position 0: none
    for lp in lps:
        row = ref[lp.position - 1]
        want = row[prompt[lp.position]].item()
        assert lp.token_id == prompt[lp.position]
        assert lp.logprob == pytest.approx(want, abs=atol)
        # 1 + the tokens strictly more likely (a tie within the tolerance may go either way)
        assert int((row > want + atol).sum()) + 1 <= lp.rank <= int((row > want - atol).sum()) + 1
        top_v, top_i = row.topk(k)
        assert [t.token_id for t in lp.top] == top_i.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top_v.tolist(), abs=atol)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 64])
def test_prompt_logprobs_equal_a_full_forward_at_any_chunk_size(tiny_dir, tiny_model, chunk):
    g = torch.Generator().manual_seed(chunk)
    prompts = {f"r{i}": torch.randint(4, VOCAB, (n,), generator=g).tolist() for i, n in enumerate((23, 9, 2))}
    runner = ModelRunner(tiny_model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS,
                         block_size=BLOCK)
    runner.hello(BLOCK)
    got, first = run_chunked(runner, prompts, chunk, k=3)
    hf = hf_model(tiny_dir)
    for rid, p in prompts.items():
        ref = reference(hf, p)
        check_against(ref, p, got[rid], k=3)
        assert first[rid] == int(ref[-1].argmax())   # the last row still samples (greedy)


def test_requests_without_prompt_logprobs_get_none_and_k0_gets_only_the_token(tiny_dir, tiny_model):
    runner = ModelRunner(tiny_model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS,
                         block_size=BLOCK)
    runner.hello(BLOCK)
    p = list(range(10, 30))
    got, _ = run_chunked(runner, {"plain": p}, 5, k=None)
    assert got["plain"] == []
    got, _ = run_chunked(runner, {"zero": p}, 5, k=0)
    assert len(got["zero"]) == len(p) - 1 and all(not lp.top for lp in got["zero"])
    check_against(reference(hf_model(tiny_dir), p), p, got["zero"], k=0)


def test_a_long_prompt_never_has_logits_for_more_than_one_slice_of_rows(tiny_dir, tiny_model):
    """The whole prompt runs in one step (a [L, V] logits tensor would be the easy way); the
    model's logits are asked for at most `slice` rows at a time, and the values stay right."""
    runner = ModelRunner(tiny_model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS,
                         block_size=BLOCK)
    runner.hello(BLOCK)
    runner.prompt_logprob_slice = 32
    rows_asked: list[int] = []
    real = tiny_model.compute_logits

    def counting(hidden):
        rows_asked.append(hidden.shape[0])
        return real(hidden)
    tiny_model.compute_logits = counting
    try:
        g = torch.Generator().manual_seed(3)
        p = torch.randint(4, VOCAB, (200,), generator=g).tolist()
        got, _ = run_chunked(runner, {"long": p}, 200, k=2)
    finally:
        tiny_model.compute_logits = real
    assert max(rows_asked) <= 32 and sum(rows_asked) == 199 + 1   # 199 scoring rows + the sampling row
    check_against(reference(hf_model(tiny_dir), p), p, got["long"], k=2)


def test_reduce_rows_ranks_and_slices_match_a_dense_computation():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g)
    hidden = torch.randn(37, 8, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    lp, rank, top_v, top_i = prompt_logprobs.reduce_rows(hidden, targets, 4, lambda h: h @ w.T, slice_rows=5)
    dense = torch.log_softmax(hidden @ w.T, dim=-1)
    want = dense.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, want)
    # rank 1 = the argmax; a target's rank is 1 + the tokens strictly more likely
    order = dense.argsort(dim=-1, descending=True)
    want_rank = (order == targets[:, None]).float().argmax(dim=-1) + 1
    assert rank.tolist() == want_rank.tolist()
    torch.testing.assert_close(top_v, dense.topk(4).values)
    assert top_i.tolist() == dense.topk(4).indices.tolist()


def full_forward_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits of every row of one unchunked forward of our own model (the
    reference path, itself pinned to transformers by test_worker_model): [L, V]."""
    from services.worker.attention import SeqSchedule, build_attn_metadata

    caches = [torch.zeros(model.kv_cache_shape(-(-len(prompt) // 16), 16), dtype=model.dtype)
              for _ in range(model.cfg.num_layers)]
    meta = build_attn_metadata([SeqSchedule(list(range(len(caches[0][0]))), 0, len(prompt))], 16, model.device,
                               model.cfg.sliding_window)
    with torch.no_grad():
        hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), meta, caches)
        return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def test_smollm2_prompt_logprobs_match_one_full_forward_with_chunked_prefill(smollm2_dir):
    from tokenizers import Tokenizer

    model = load_model(smollm2_dir, dtype=torch.float32, max_model_len=256)
    runner = ModelRunner(model, model_name="smollm2", kv_cache_bytes=0, num_kv_blocks=64, block_size=16)
    runner.hello(16)
    p = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(
        "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain").ids
    got, _ = run_chunked(runner, {"s": p}, 7, k=5)
    check_against(full_forward_logprobs(model, p), p, got["s"], k=5, atol=1e-3)


def test_the_gpu_executor_path_gives_the_reference_prompt_logprobs(tiny_model):
    """GpuExecutor (persistent buffers + Triton forward, eager prefill) keeps the step's hidden
    rows for the prompt logprobs: the same values as the torch reference path, chunk by chunk."""
    pytest.importorskip("triton")
    from services.worker.gpu_exec import GpuExecutor

    g = torch.Generator().manual_seed(9)
    prompts = {"a": torch.randint(4, VOCAB, (13,), generator=g).tolist(),
               "b": torch.randint(4, VOCAB, (6,), generator=g).tolist()}
    got = []
    for kernels in (False, True):
        runner = ModelRunner(tiny_model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS,
                             block_size=BLOCK)
        runner.hello(BLOCK)
        if kernels:
            runner.gpu = GpuExecutor(tiny_model, runner.kv_caches, BLOCK, max_num_tokens=64, max_num_seqs=4,
                                     graph_sizes=None)
        got.append(run_chunked(runner, prompts, 4, k=2))
    (ref, ref_first), (kern, kern_first) = got
    assert kern_first == ref_first
    for rid in prompts:
        assert [(lp.position, lp.token_id, lp.rank, [t.token_id for t in lp.top]) for lp in kern[rid]] == \
            [(lp.position, lp.token_id, lp.rank, [t.token_id for t in lp.top]) for lp in ref[rid]]
        assert [lp.logprob for lp in kern[rid]] == pytest.approx([lp.logprob for lp in ref[rid]], abs=1e-4)


def test_a_request_resumed_with_outputs_is_not_scored_again(tiny_model):
    """After a preemption past the first token the prompt's logprobs were delivered: the resumed
    request (its outputs among its tokens) computes its prefix again but scores nothing."""
    from services.common import pb
    from services.worker.wire import ProtoRunner

    runner = ModelRunner(tiny_model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS,
                         block_size=BLOCK)
    runner.hello(BLOCK)
    tokens = list(range(20, 32))     # 10 prompt tokens + 2 outputs
    plan = pb.step.StepPlan(step_id=1)
    plan.new_requests.add(request_id="r", token_ids=tokens, block_ids=[0, 1, 2, 3],
                          sampling=pb.common.SamplingParams(max_tokens=8, prompt_logprobs=3),
                          num_computed_tokens=0, num_scheduled_tokens=len(tokens), num_output_tokens=2)
    out = ProtoRunner(runner).execute(plan).outputs[0]
    assert len(out.token_ids) == 1 and not out.prompt_logprobs
