"""ModelRunner driven with handmade StepPlans on a tiny model (through the worker's wire edge, as
the engine drives it): greedy output equals transformers' generate, bad plans give
StepResult.error and the runner keeps working."""
from __future__ import annotations

import pytest
import torch

from services.common import pb
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.unit.tiny_llama import VOCAB, hf_model, make_tiny_llama
from tests.worker_driver import MiniScheduler

BLOCK = 4
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-runner"), seed=11)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture
def runner(model):
    r = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    r.hello(BLOCK)
    return r


def hf_greedy(tiny_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    hf = hf_model(tiny_dir)
    hf.generation_config.eos_token_id = None  # never stop early: compare exactly max_new tokens
    outs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        outs.append(out[0, len(p):].tolist())
    return outs


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(42)
    return [torch.randint(4, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_runner_greedy_matches_transformers_generate_with_chunked_prefill(tiny_dir, runner):
    ps = prompts(4)
    expected = hf_greedy(tiny_dir, ps, 12)
    sched = MiniScheduler(ProtoRunner(runner).execute, BLOCK, NUM_BLOCKS, budget=7)  # forces prompt chunks and mixed steps
    for i, p in enumerate(ps):
        sched.add(f"r{i}", p, 12)
    got = sched.run()
    assert [got[f"r{i}"] for i in range(4)] == expected
    assert runner.requests == {}, "finished requests must be dropped"


def test_preempted_request_resumes_with_same_output(tiny_dir, runner):
    (p,) = prompts(1)
    expected = hf_greedy(tiny_dir, [p], 10)[0]
    sched = MiniScheduler(ProtoRunner(runner).execute, BLOCK, NUM_BLOCKS, budget=64)
    sched.add("x", p, 10)
    for _ in range(4):
        sched.step()
    sched.preempt("x")  # comes back as NewRequest with prompt + 4 outputs
    assert sched.run()["x"] == expected


def test_seeded_sampling_is_independent_of_batch_and_logprobs_come_back(runner, model):
    sp = pb.common.SamplingParams(temperature=1.0, top_p=0.9, seed=77, logprobs=3)
    (p,) = prompts(1)

    def run(extra: int) -> list[int]:
        r = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
        s = MiniScheduler(ProtoRunner(r).execute, BLOCK, NUM_BLOCKS, budget=64, seed=extra)
        for i in range(extra):
            s.add(f"o{i}", prompts(extra)[i], 8, pb.common.SamplingParams(temperature=0.8, seed=i))
        s.add("seeded", p, 8, sp)
        return s.run()["seeded"]

    assert run(0) == run(3)
    plan = pb.step.StepPlan(step_id=1)
    plan.new_requests.add(request_id="lp", token_ids=p, block_ids=list(range(8)), sampling=sp,
                          num_scheduled_tokens=len(p))
    out = ProtoRunner(runner).execute(plan).outputs[0]
    assert len(out.logprobs) == 1 and out.logprobs[0].token_id == out.token_ids[0]
    assert len(out.logprobs[0].top) == 3 and out.logprobs[0].logprob <= 0.0


def _plan(**kw) -> pb.step.StepPlan:
    return pb.step.StepPlan(step_id=9, **kw)


@pytest.mark.parametrize("bad", [
    dict(cached_requests=[pb.step.CachedRequest(request_id="ghost", num_computed_tokens=0, num_scheduled_tokens=1)]),
    dict(new_requests=[pb.step.NewRequest(request_id="a", token_ids=[5, 6], block_ids=[NUM_BLOCKS],
                                          num_scheduled_tokens=2)]),
    dict(new_requests=[pb.step.NewRequest(request_id="a", token_ids=[5, 6], block_ids=[0],
                                          num_scheduled_tokens=3)]),
    dict(new_requests=[pb.step.NewRequest(request_id="a", token_ids=[5] * 9, block_ids=[0, 1],
                                          num_scheduled_tokens=9)]),
    dict(new_requests=[pb.step.NewRequest(request_id="a", token_ids=[VOCAB + 1], block_ids=[0],
                                          num_scheduled_tokens=1)]),
    dict(new_requests=[pb.step.NewRequest(request_id="a", token_ids=[5], block_ids=[0],
                                          num_scheduled_tokens=0)]),
    dict(new_requests=[pb.step.NewRequest(request_id="a", token_ids=[5], block_ids=[0], num_scheduled_tokens=1,
                                          sampling=pb.common.SamplingParams(temperature=-2))]),
], ids=["unknown-id", "block-out-of-range", "more-tokens-than-known", "blocks-too-few",
        "token-out-of-vocab", "zero-tokens", "negative-temperature"])
def test_malformed_plan_yields_error_and_runner_keeps_working(tiny_dir, runner, bad):
    # A healthy request in flight before the bad plan must be unaffected by it.
    (p,) = prompts(1)
    expected = hf_greedy(tiny_dir, [p], 5)[0]
    sched = MiniScheduler(ProtoRunner(runner).execute, BLOCK, NUM_BLOCKS, budget=64)
    sched.add("good", p, 5)
    sched.step()
    result = ProtoRunner(runner).execute(_plan(**bad))
    assert result.HasField("error") and result.error.code == pb.common.ERROR_CODE_INVALID_ARGUMENT
    assert result.step_id == 9 and not result.outputs
    assert "a" not in runner.requests
    assert sched.run()["good"] == expected


def test_duplicate_new_request_is_rejected(runner):
    nr = pb.step.NewRequest(request_id="d", token_ids=[5, 6], block_ids=[0], num_scheduled_tokens=2)
    execute = ProtoRunner(runner).execute
    assert not execute(_plan(new_requests=[nr])).HasField("error")
    assert execute(_plan(new_requests=[nr])).HasField("error")
    # ...but allowed again once the same plan lists it as finished (a resumed preemption).
    assert not execute(_plan(new_requests=[nr], finished_ids=["d"])).HasField("error")


def test_hello_reports_worker_info_and_reallocates_on_block_size_change(model):
    r = ProtoRunner(ModelRunner(model, model_name="tiny", kv_cache_bytes=4 * model.kv_bytes_per_block(16)))
    info = r.hello(16)
    assert (info.num_kv_blocks, info.block_size, info.vocab_size) == (4, 16, VOCAB)
    assert list(info.eos_token_ids) == [2, 3] and info.model_name == "tiny" and info.device == "cpu"
    assert info.max_model_len == model.max_model_len
    info = r.hello(8)
    assert (info.num_kv_blocks, info.block_size) == (8, 8)
    assert r.runner.kv_caches[0].shape == (2, 8, 8, 2, 8)
