"""Speculative decoding with tensor parallel: a real `python -m services.worker
--tensor-parallel-size 2 --speculative-config ...` (rank 0 and the rank it starts, gloo on the CPU),
driven over its ZMQ socket by the real scheduler core with two plans in flight, as the mesh's
async scheduling does. Rank 0's choices (whether to read the previous step first, which drafts)
are every rank's (runner.tp_spec: tp_ranks.TpLink.agree_flag / agree_drafts): the ranks never
diverge, and the tokens are plain decoding's on the same weights run whole."""
from __future__ import annotations

import json
from collections import deque

import pytest

from services.common import pb
from services.scheduler import wire as sched_wire
from services.scheduler.core import Request, Scheduler, SchedulerConfig
from services.worker.models import load_model
from tests.overlap_driver import run as run_in_process
from tests.unit.test_spec_decoding import mix, repetitive
from tests.unit.test_spec_draft_model import TOKENIZER
from tests.unit.test_worker_tp_kv import BS, TpWorker
from tests.unit.tiny_llama import VOCAB, make_tiny_llama

K = 3
# A fixed K: on this CPU the cost model may well decline to draft (steps grow with their tokens);
# which drafts are verified is still rank 0's choice alone.
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "dynamic_k": [[1, 64, K]]}


def drive(worker: TpWorker, prompts, samplings, new_tokens: int) -> tuple[dict, int, int]:
    """The scheduler core with depth 2 (submit N+1, then collect N) -> (outputs, drafts verified,
    tokens accepted) as the scheduler sees them."""
    info = worker.hello()
    cfg = SchedulerConfig(max_model_len=256, block_size=BS, max_num_batched_tokens=64, max_num_seqs=8,
                          num_spec_tokens=K)
    core = Scheduler(cfg, info.num_kv_blocks, frozenset(), VOCAB)
    for i, (p, sp) in enumerate(zip(prompts, samplings)):
        core.add_request(Request(f"r{i}", list(p), new_tokens, sampling=sp, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    inflight: deque = deque()
    drafted = accepted = 0

    def finish():
        nonlocal drafted, accepted
        plan = inflight.popleft()
        assert worker.sock.poll(120_000), f"no reply from the worker: {worker.tail()}"
        reply = pb.step.WorkerReply.FromString(worker.sock.recv())
        result = reply.result
        assert not result.HasField("error"), result.error
        for o in result.outputs:
            if o.num_draft_tokens:
                drafted += o.num_draft_tokens
                accepted += len(o.token_ids) - 1
        for out in core.update(plan, sched_wire.result_from_proto(result)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    for _ in range(2000):
        if not (inflight or core.has_work()):
            break
        if len(inflight) < 2 and core.has_work():
            plan = core.schedule()
            if not plan.is_empty():
                worker.sock.send(sched_wire.plan_to_proto(plan).SerializeToString())
                inflight.append(plan)
                if len(inflight) < 2:
                    continue
        if inflight:
            finish()
    assert not inflight and not core.has_work()
    return outputs, drafted, accepted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tp-spec") / "tiny", seed=7)
    (path / "tokenizer.json").write_text(json.dumps(TOKENIZER))   # the draft model's tokenizer check
    return path


def tp_and_whole(model_dir, tmp_path, name: str, spec: dict, ps, sps, new_tokens: int = 16):
    """A TP=2 worker speculating with `spec`, rank 0 overlapping steps, against plain decoding of
    the whole model in this process -> (outputs, expected, drafts verified, tokens accepted)."""
    want, _, _, _ = run_in_process(load_model(model_dir), ps, sps, overlap=False, new_tokens=new_tokens)
    w = TpWorker(model_dir, tmp_path, name, "--speculative-config", json.dumps(spec), "--overlap-steps", "on")
    try:
        w.wait_listening()
        got, drafted, accepted = drive(w, ps, sps, new_tokens)
    finally:
        w.stop()
    return got, want, drafted, accepted


def test_tp2_workers_speculate_with_rank_0s_choices_and_give_plain_decodings_tokens(model_dir, tmp_path):
    """Rank 0 overlaps steps (it decides to read the previous step before it builds a speculating
    one); rank 1 runs each request as it comes: they agree because rank 1 takes rank 0's choices."""
    ps, sps = repetitive(6), [mix(i) for i in range(6)]
    got, want, drafted, _ = tp_and_whole(model_dir, tmp_path, "spec", SPEC, ps, sps)
    assert got == want
    assert drafted > 0, "drafts were verified on both ranks (this random model rejects n-gram drafts: the test below accepts)"


def test_tp2_with_a_draft_model_on_rank_0_accepts_its_self_drafts_on_every_rank(model_dir, tmp_path):
    """The draft model runs whole on rank 0 only; rank 1 verifies the drafts rank 0 sends. The
    model drafting for itself: greedy drafts accepted, so both ranks advance by accepted runs."""
    ps = repetitive(4)
    sps = [pb.common.SamplingParams(ignore_eos=True)] * 2 + [mix(1), mix(3)]
    spec = {"method": "draft_model", "num_speculative_tokens": K, "model": str(model_dir), "dynamic_k": [[1, 64, K]]}
    got, want, drafted, accepted = tp_and_whole(model_dir, tmp_path, "draft", spec, ps, sps)
    assert got == want
    # Greedy rows accept their self-drafts; the two sampled rows accept only where the sample
    # equals the greedy draft.
    assert accepted > 0 and accepted / drafted > 0.3, (drafted, accepted)


def test_the_ranks_flags_carry_the_speculative_config(model_dir):
    from services.worker.config import WorkerConfig
    from services.worker.main import parse_args
    from services.worker.tp_ranks import _rank_args
    cfg = WorkerConfig(model=str(model_dir), zmq_addr="tcp://127.0.0.1:5", speculative_config=json.dumps(SPEC),
                       tensor_parallel_size=2, tp_init_method="tcp://127.0.0.1:6")
    assert json.loads(parse_args(_rank_args(cfg, 1)).speculative_config) == SPEC
