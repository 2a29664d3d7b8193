"""The scheduler core driven on the CPU with handmade step results (no worker, no sockets)."""
from __future__ import annotations

import pytest

from services.common import pb
from services.common.sampling_rules import Limits, fit_to_prompt
from services.scheduler.core import FinishReason, Request, Scheduler, SchedulerConfig, StepResult

from tests.unit.scheduler_sim import EOS, VOCAB, FakeWorker, drive


def make(num_blocks=64, **kw) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=kw.pop("max_model_len", 256), block_size=4, **kw)
    return Scheduler(cfg, num_blocks, frozenset({EOS}), VOCAB)


def run_to_completion(s: Scheduler, worker: FakeWorker, max_steps=10_000):
    return drive(s, worker, max_steps=max_steps)


def req(rid, n_prompt, max_tokens, **kw) -> Request:
    base = sum(map(ord, rid))
    return Request(rid, [(base + i) % 900 for i in range(n_prompt)], max_tokens, **kw)


def solo_output(n_prompt, max_tokens, rid) -> list[int]:
    s, w = make(), FakeWorker()
    s.add_request(req(rid, n_prompt, max_tokens))
    return run_to_completion(s, w)[0][rid]


def test_requests_stop_at_max_tokens_and_free_their_blocks():
    s, w = make(), FakeWorker()
    s.add_request(req("a", 10, 5))
    s.add_request(req("b", 3, 8))
    outputs, reasons, _ = run_to_completion(s, w)
    assert len(outputs["a"]) == 5 and len(outputs["b"]) == 8
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert s.pool.num_free == s.pool.num_blocks
    assert not s.requests


def test_batched_requests_produce_their_solo_outputs():
    s, w = make(max_num_batched_tokens=16, max_num_seqs=4), FakeWorker()
    specs = {f"r{i}": (3 + 5 * i, 4 + i) for i in range(8)}
    for rid, (n, m) in specs.items():
        s.add_request(req(rid, n, m))
    outputs, _, plans = run_to_completion(s, w)
    for rid, (n, m) in specs.items():
        assert outputs[rid] == solo_output(n, m, rid)
    assert max(len(p.scheduled_ids) for p in plans) <= 4
    assert max(p.num_scheduled_tokens for p in plans) <= 16


def test_long_prompt_is_chunked_and_does_not_stall_running_decodes():
    s, w = make(max_num_batched_tokens=8), FakeWorker()
    s.add_request(req("short", 2, 20))
    plan = s.schedule()
    s.update(plan, w.run(plan))                 # "short" is now decoding
    s.add_request(req("long", 30, 2))
    decode_steps_during_prefill = 0
    while "long" in s.requests and s.requests["long"].num_computed_tokens < 30:
        plan = s.schedule()
        ids = plan.scheduled_ids
        assert "short" in ids, "a running decode was stalled by a long prompt"
        assert plan.num_scheduled_tokens <= 8
        decode_steps_during_prefill += 1
        s.update(plan, w.run(plan))
    assert decode_steps_during_prefill >= 30 // 7


def test_plans_are_diffs_new_requests_once_then_only_new_blocks():
    s, w = make(), FakeWorker()
    s.add_request(req("a", 6, 10))
    first = s.schedule()
    assert [r.request_id for r in first.new_requests] == ["a"]
    assert first.new_requests[0].block_ids and not first.cached_requests
    s.update(first, w.run(first))
    seen_blocks = list(first.new_requests[0].block_ids)
    for _ in range(9):
        plan = s.schedule()
        assert not plan.new_requests and [r.request_id for r in plan.cached_requests] == ["a"]
        seen_blocks += plan.cached_requests[0].new_block_ids
        s.update(plan, w.run(plan))
    assert seen_blocks == w.blocks.get("a", seen_blocks)
    final = s.schedule()
    assert final.finished_ids == ["a"]


def test_eos_stops_unless_ignore_eos_and_respects_min_tokens():
    for kw, expect_len, reason in [({}, 2, FinishReason.STOP), ({"ignore_eos": True}, 6, FinishReason.LENGTH),
                                   ({"min_tokens": 5}, 6, FinishReason.LENGTH), ({"min_tokens": 4}, 4, FinishReason.STOP)]:
        s, w = make(), FakeWorker()
        s.add_request(req("a", 3, 6, **kw))
        w.forced["a"] = [5, EOS, 7, EOS, 8, 9]
        outputs, reasons, _ = run_to_completion(s, w)
        assert len(outputs["a"]) == expect_len, kw
        assert reasons["a"] == reason, kw


def test_stop_token_ids_finish_with_stop():
    s, w = make(), FakeWorker()
    s.add_request(req("a", 3, 10, stop_token_ids=frozenset({42})))
    w.forced["a"] = [1, 2, 42, 3]
    outputs, reasons, _ = run_to_completion(s, w)
    assert outputs["a"] == [1, 2, 42] and reasons["a"] == FinishReason.STOP


def test_abort_frees_blocks_and_tells_the_worker():
    s, w = make(), FakeWorker()
    s.add_request(req("a", 9, 50))
    s.add_request(req("b", 9, 50))
    plan = s.schedule()
    s.update(plan, w.run(plan))
    s.abort(["a", "unknown"])
    plan = s.schedule()
    assert "a" in plan.finished_ids and "a" not in plan.scheduled_ids
    outs = s.update(plan, w.run(plan))
    assert any(o.request_id == "a" and o.finish_reason == FinishReason.ABORT for o in outs)
    assert "a" not in s.requests and "a" not in w.tokens
    s.abort(["b"])
    s.update(s.schedule(), StepResult(0))
    assert s.pool.num_free == s.pool.num_blocks


def test_preempted_request_resumes_with_same_output():
    # 12 blocks of 4 tokens: three requests growing to 20 tokens each cannot all fit.
    s, w = make(num_blocks=12), FakeWorker()
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 8, 12))
    outputs, reasons, plans = run_to_completion(s, w)
    assert s.num_preemptions > 0
    resumed = [r for p in plans for r in p.new_requests if r.num_output_tokens > 0]
    assert resumed, "a preempted request must come back as a new request with its outputs"
    for rid in ("a", "b", "c"):
        assert outputs[rid] == solo_output(8, 12, rid)
        assert reasons[rid] == FinishReason.LENGTH
    assert s.pool.num_free == 12


@pytest.mark.parametrize("prompt_len,max_tokens,msg", [
    (0, 5, "empty"), (256, 5, "context length"), (300, 5, "context length"), (10, 10_000, "KV cache"),
])
def test_invalid_requests_are_rejected_with_a_clear_error(prompt_len, max_tokens, msg):
    s = make(num_blocks=8, max_model_len=4096)
    s.config.max_model_len = 256 if prompt_len >= 256 else 4096
    err = s.add_request(req("x", prompt_len, max_tokens))
    assert err is not None and msg in err
    [out] = s.take_pending_outputs()
    assert out.finish_reason == FinishReason.ERROR and out.error_code == "invalid_argument"
    assert not s.requests


def test_out_of_vocab_token_is_rejected():
    s = make()
    err = s.add_request(Request("x", [1, VOCAB + 5], 3))
    assert err is not None and "out of range" in err


def test_max_tokens_resolved_up_to_the_context_length_runs_to_it():
    # The gateway resolves max_tokens 0 ("up to the context") before submitting; the core
    # runs what it is given.
    s, w = make(max_model_len=20), FakeWorker()
    a = req("a", 5, 0, ignore_eos=True)
    a.max_tokens = fit_to_prompt(pb.common.SamplingParams(), a.prompt_token_ids,
                                 Limits(max_model_len=20, vocab_size=VOCAB)).max_tokens
    s.add_request(a)
    outputs, reasons, _ = run_to_completion(s, w)
    assert len(outputs["a"]) == 15 and reasons["a"] == FinishReason.LENGTH


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_a_submit_without_a_resolved_max_tokens_is_malformed(max_tokens):
    s = make()
    err = s.add_request(req("x", 4, max_tokens))
    assert err is not None and "max_tokens" in err
    [out] = s.take_pending_outputs()
    assert out.finish_reason == FinishReason.ERROR and out.error_code == "invalid_argument"
    assert not s.requests


def test_worker_error_fails_the_step_requests_not_the_engine():
    s, w = make(), FakeWorker()
    s.add_request(req("a", 4, 5))
    plan = s.schedule()
    outs = s.update(plan, StepResult(plan.step_id, error="boom"))
    assert outs[0].finish_reason == FinishReason.ERROR and "boom" in outs[0].error_message
    s.add_request(req("b", 4, 3))
    outputs, reasons, _ = run_to_completion(s, w)
    assert len(outputs["b"]) == 3
