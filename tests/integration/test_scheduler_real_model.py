"""The scheduler core driving the real worker runner on SmolLM2: greedy outputs do not depend
on async scheduling, prefix caching, preemption or the chunk size."""
from __future__ import annotations

import pytest
import torch

from services.common import pb
from services.scheduler import wire
from services.scheduler.core import Request, Scheduler, SchedulerConfig
from tests.unit.scheduler_sim import Driver

NEW_TOKENS = 12
SHARED = ("You are a helpful assistant. Answer briefly and precisely, and never make things up. "
          "The user asks: ")
QUESTIONS = ["What is the boiling point of water?", "Name a prime number larger than ten.",
             "Who wrote Hamlet?", "What colour is the sky on a clear day?", "How many legs does a spider have?",
             "What is the capital of Japan?"]


class RealWorker:
    """Adapts the real ModelRunner to the simulated-worker interface the Driver uses; the plans
    cross both wire edges (the scheduler's and the worker's) as they do over ZMQ."""

    def __init__(self, runner) -> None:
        from services.worker.wire import ProtoRunner
        self.runner = ProtoRunner(runner)

    def run(self, plan):
        result = self.runner.execute(wire.plan_to_proto(plan).plan)
        assert not result.HasField("error"), result.error.message
        return wire.result_from_proto(result)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from services.worker.models.loader import load_model
    return load_model(smollm2_dir, "cpu", torch.float32, max_model_len=512)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [tok.encode(SHARED + q).ids for q in QUESTIONS]


def run(model, prompts, *, num_blocks=200, budget=2048, async_depth=1, prefix_caching=False, passes=1):
    from services.worker.runner import ModelRunner
    runner = ModelRunner(model, model_name="smollm2", kv_cache_bytes=0, num_kv_blocks=num_blocks, block_size=16)
    info = runner.hello(16)
    cfg = SchedulerConfig(max_model_len=512, max_num_batched_tokens=budget, max_num_seqs=8, block_size=16,
                          enable_prefix_caching=prefix_caching)
    s = Scheduler(cfg, info.num_kv_blocks, frozenset(info.eos_token_ids), info.vocab_size)
    sampling = pb.common.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = {}
    for p in range(passes):
        d = Driver(s, RealWorker(runner), async_depth)
        for i, ids in enumerate(prompts):
            s.add_request(Request(f"p{p}-r{i}", list(ids), NEW_TOKENS, sampling=sampling, ignore_eos=True))
        while d.busy:
            d.step()
        outputs.update({rid.split("-", 1)[1]: toks for rid, toks in d.outputs.items()})
    return outputs, s


@pytest.fixture(scope="module")
def baseline(model, prompts):
    outputs, _ = run(model, prompts)
    assert all(len(v) == NEW_TOKENS for v in outputs.values())
    return outputs


def test_async_scheduling_on_gives_the_same_greedy_outputs(model, prompts, baseline):
    outputs, _ = run(model, prompts, async_depth=2)
    assert outputs == baseline


def test_prefix_caching_on_gives_the_same_greedy_outputs_and_hits(model, prompts, baseline):
    outputs, s = run(model, prompts, prefix_caching=True, passes=2)
    assert outputs == baseline
    assert s.kv.stats.hits >= len(prompts) * 16, "the second pass should hit the cache for every prompt"


def test_forced_preemption_gives_the_same_greedy_outputs(model, prompts, baseline):
    outputs, s = run(model, prompts, num_blocks=9, async_depth=2, prefix_caching=True)
    assert s.num_preemptions > 0
    assert outputs == baseline


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_gives_the_same_greedy_outputs(model, prompts, baseline, budget):
    outputs, _ = run(model, prompts, budget=budget, async_depth=2)
    assert outputs == baseline
