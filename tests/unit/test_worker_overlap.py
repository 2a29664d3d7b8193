"""Host/GPU overlap in the runner (runner.submit / collect): step N+1 is launched before step
N's tokens are read, its decode inputs taken from the sampler's device buffer. Driven here by the
real scheduler core with async scheduling, exactly as the worker's engine loop pipelines it, the
overlapped runner must produce the very tokens (and logprobs) of the plain synchronous one:
greedy, seeded sampling, penalties (which need the host's history first), logprobs, chunked
prefill and preemption. The CPU reference forward and (under Triton's interpreter) the GPU
executor's forward both read the pending ids through the same src mechanism.
"""
from __future__ import annotations

import os
import pytest
import torch

# The GPU-executor case runs the Triton kernels through the interpreter; like
# test_worker_kernels.py, set it before any kernel module is imported (decorated).
os.environ["TRITON_INTERPRET"] = "1"

from services.common import pb  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from services.worker.wire import ProtoRunner  # noqa: E402
from tests.overlap_driver import BLOCK, NEW, run, sampling_mix  # noqa: E402
from tests.overlap_driver import prompts as _prompts  # noqa: E402
from tests.unit.tiny_llama import VOCAB, make_tiny_llama  # noqa: E402


def prompts(n: int) -> list[list[int]]:
    return _prompts(n, VOCAB)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-overlap"), seed=5))


def test_overlapped_runner_gives_the_synchronous_tokens_and_logprobs(model):
    ps = prompts(8)
    sps = [sampling_mix(i) for i in range(8)]
    want, want_lp, _, _ = run(model, ps, sps, overlap=False, budget=16)   # chunked prefill too
    got, got_lp, _, depth = run(model, ps, sps, overlap=True, budget=16)
    assert all(len(v) == NEW for v in want.values())
    assert got == want
    assert got_lp.keys() == want_lp.keys()
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=1e-5)
    assert depth == 2, "step N+1 should have been launched before step N was collected"


def test_all_greedy_batches_keep_each_steps_own_tokens(model):
    """All-greedy steps sample straight into the prev-token buffer that the next step overwrites:
    a step collected after its successor ran must still report its own tokens."""
    ps = prompts(4)
    sps = [pb.common.SamplingParams(ignore_eos=True)] * 4
    want, _, _, _ = run(model, ps, sps, overlap=False)
    got, _, _, depth = run(model, ps, sps, overlap=True)
    assert got == want and depth == 2


def forward_watch(seen: list[int]):
    """Records, at each reference forward, how many earlier steps' tokens are still unread."""
    def watch(runner):
        forward = runner._forward_reference

        def spy(*args):
            seen.append(runner.num_unresolved)
            return forward(*args)
        runner._forward_reference = spy
    return watch


def test_penalties_read_the_pending_token_after_the_forward_is_launched(model):
    """A penalised request needs its full history on the host before it samples, not before its
    forward runs: the previous step is still unread when the next forward starts, and read before
    the next step returns (no two steps stay unresolved)."""
    ps = prompts(3)
    sps = [pb.common.SamplingParams(presence_penalty=1.5, ignore_eos=True)] * 3
    want, _, _, _ = run(model, ps, sps, overlap=False)
    unread: list[int] = []
    got, _, _, depth = run(model, ps, sps, overlap=True, watch=forward_watch(unread))
    assert got == want
    assert depth == 1
    assert max(unread) == 1, "each decode forward should start before the previous step's tokens are read"


def test_overlap_survives_preemption(model):
    """9 blocks of 4 tokens for 6 requests: recompute preemptions replace worker state while a
    token of the replaced request may still be pending."""
    ps = prompts(6)
    sps = [sampling_mix(i) for i in range(6)]
    want, _, _, _ = run(model, ps, sps, overlap=False, num_blocks=64)
    got, _, s, _ = run(model, ps, sps, overlap=True, num_blocks=9)
    assert s.num_preemptions > 0
    assert got == want


def test_rejected_plan_while_a_step_is_in_flight_leaves_the_runner_working(model):
    model_runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=16, block_size=BLOCK)
    model_runner.hello(BLOCK)
    model_runner.overlap = True
    runner = ProtoRunner(model_runner)
    plan = pb.step.StepPlan(step_id=1)
    plan.new_requests.add(request_id="a", token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3,
                          sampling=pb.common.SamplingParams(ignore_eos=True))
    first = runner.submit(plan)
    bad = pb.step.StepPlan(step_id=2)
    bad.cached_requests.add(request_id="a", num_computed_tokens=3, num_scheduled_tokens=2)  # 1 token unknown
    rejected = runner.submit(bad)
    assert runner.collect(rejected).error.code == pb.common.ERROR_CODE_INVALID_ARGUMENT
    tok = runner.collect(first).outputs[0].token_ids[0]
    good = pb.step.StepPlan(step_id=3)
    good.cached_requests.add(request_id="a", num_computed_tokens=3, num_scheduled_tokens=1)
    res = runner.collect(runner.submit(good))
    assert not res.HasField("error") and len(res.outputs[0].token_ids) == 1
    assert model_runner.requests["a"].token_ids[:4] == [5, 6, 7, tok]


def test_gpu_executor_path_reads_pending_ids_on_the_device(model, monkeypatch):
    """The GPU executor's forward (persistent buffers, src row, the Triton embedding kernel that
    resolves pending ids) under the interpreter: same tokens as the synchronous reference."""
    pytest.importorskip("triton")
    from services.worker.gpu_exec import GpuExecutor
    ps = prompts(3)
    sps = [sampling_mix(i) for i in (0, 1, 3)]
    # 5 new tokens: four decode steps, each reading the previous step's ids still on the device,
    # are enough here; every interpreted step costs about a second on the CI's CPU.
    want, _, _, _ = run(model, ps, sps, overlap=False, new_tokens=5)
    got, _, _, depth = run(model, ps, sps, overlap=True, new_tokens=5, executor=lambda r: GpuExecutor(
        model, r.kv_caches, BLOCK, max_num_tokens=64, max_num_seqs=8, graph_sizes=None))
    assert got == want and depth == 2
