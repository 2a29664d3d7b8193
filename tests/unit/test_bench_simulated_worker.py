"""The simulated worker keeps the real worker's step contract without a model (driven through
the worker's wire edge, as its engine loop drives it)."""
import json

import pytest

from services.common import pb
from services.worker import wire
from services.worker.simulated import SimSpec, SimulatedRunner


def execute(runner: SimulatedRunner, plan: pb.step.StepPlan) -> tuple[pb.step.StepResult, int]:
    """-> (the step's result, the tokens it scheduled: what its simulated time is charged for)."""
    step = runner.submit(wire.plan_from_proto(plan, runner.vocab_size))
    return wire.result_to_proto(runner.collect(step)), step.num_tokens


@pytest.fixture
def runner(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 1000, "eos_token_id": 2, "max_position_embeddings": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    spec = SimSpec.from_model_dir(str(tmp_path))
    return SimulatedRunner(spec, model_name="sim", kv_cache_bytes=1 << 20, block_size=16)


def test_hello_reports_the_model_dirs_vocab_eos_and_context(runner):
    info = runner.hello(16)
    assert (info.vocab_size, list(info.eos_token_ids), info.max_model_len) == (1000, [2], 256)
    # 1 MiB / (2 * 2 layers * 2 kv heads * 16 head dim * 4 bytes * 16 tokens)
    assert info.num_kv_blocks == (1 << 20) // (2 * 2 * 2 * 16 * 4 * 16)


def test_chunked_prefill_then_decodes_with_plans_sent_ahead(runner):
    runner.hello(16)
    # step 0: the first 6 of 10 prompt tokens: nothing sampled
    plan0 = pb.step.StepPlan(step_id=0)
    plan0.new_requests.add(request_id="r", token_ids=list(range(10, 20)), block_ids=[0],
                           num_computed_tokens=0, num_scheduled_tokens=6)
    r0, n0 = execute(runner, plan0)
    assert n0 == 6 and [list(o.token_ids) for o in r0.outputs] == [[]]
    # step 1 reaches the end of the prompt: one token sampled
    plan1 = pb.step.StepPlan(step_id=1)
    plan1.cached_requests.add(request_id="r", num_computed_tokens=6, num_scheduled_tokens=4)
    r1, _ = execute(runner, plan1)
    # steps 2 and 3 are decodes planned before the scheduler saw results: each runs the token
    # this worker sampled in the step before, and samples the next
    plans = []
    for step, computed in ((2, 10), (3, 11)):
        p = pb.step.StepPlan(step_id=step)
        p.cached_requests.add(request_id="r", num_computed_tokens=computed, num_scheduled_tokens=1)
        plans.append(p)
    outs = [execute(runner, p)[0] for p in plans]
    sampled = [o.outputs[0].token_ids[0] for o in (r1, *outs)]
    assert len(sampled) == 3 and all(100 <= t < 1000 and t != 2 for t in sampled)
    assert runner.requests["r"][0] == 13  # 10 prompt + 3 sampled
    # a decode that runs past the known tokens is refused, and changes nothing
    bad = pb.step.StepPlan(step_id=4)
    bad.cached_requests.add(request_id="r", num_computed_tokens=13, num_scheduled_tokens=2)
    res, _ = execute(runner, bad)
    assert res.HasField("error") and runner.requests["r"][0] == 13


def test_finished_ids_drop_state_and_the_id_may_return_after_preemption(runner):
    runner.hello(16)
    p = pb.step.StepPlan(step_id=0)
    p.new_requests.add(request_id="r", token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3)
    execute(runner, p)
    again = pb.step.StepPlan(step_id=1, finished_ids=["r"])
    again.new_requests.add(request_id="r", token_ids=[5, 6, 7, 8], block_ids=[1], num_scheduled_tokens=4,
                           num_output_tokens=1)
    res, _ = execute(runner, again)
    assert not res.HasField("error") and len(res.outputs[0].token_ids) == 1
    res, _ = execute(runner, pb.step.StepPlan(step_id=2, finished_ids=["r"]))
    assert not runner.requests and not res.outputs
    unknown = pb.step.StepPlan(step_id=3)
    unknown.cached_requests.add(request_id="r", num_computed_tokens=4, num_scheduled_tokens=1)
    assert execute(runner, unknown)[0].error.code == pb.common.ERROR_CODE_INVALID_ARGUMENT


def test_sampling_is_deterministic_per_request_id(runner, tmp_path):
    def sample_three(r):
        r.hello(16)
        p = pb.step.StepPlan(step_id=0)
        p.new_requests.add(request_id="same", token_ids=[1, 2], block_ids=[0], num_scheduled_tokens=2)
        toks = [execute(r, p)[0].outputs[0].token_ids[0]]
        for i in range(2):
            q = pb.step.StepPlan(step_id=i + 1)
            q.cached_requests.add(request_id="same", num_computed_tokens=2 + i, num_scheduled_tokens=1)
            toks.append(execute(r, q)[0].outputs[0].token_ids[0])
        return toks
    other = SimulatedRunner(runner.spec, model_name="sim", kv_cache_bytes=1 << 20)
    assert sample_three(runner) == sample_three(other)
