"""Prefix caching, priority scheduling and async scheduling in the scheduler core."""
from __future__ import annotations

from collections import Counter

import pytest

from services.scheduler.core import FinishReason, Request, Scheduler, SchedulerConfig
from tests.unit.scheduler_sim import EOS, VOCAB, FakeWorker, drive

BS = 4


def make(num_blocks=64, **kw) -> Scheduler:
    hash_fn = kw.pop("hash_fn", None)
    cfg = SchedulerConfig(max_model_len=kw.pop("max_model_len", 256), block_size=BS, **kw)
    extra = {"hash_fn": hash_fn} if hash_fn else {}
    return Scheduler(cfg, num_blocks, frozenset({EOS}), VOCAB, **extra)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 900 for i in range(n)]


def solo(tokens: list[int], max_tokens: int) -> list[int]:
    s, w = make(enable_prefix_caching=False), FakeWorker(BS)
    s.add_request(Request("solo", list(tokens), max_tokens))
    return drive(s, w)[0]["solo"]


def check_invariants(s: Scheduler) -> None:
    owners = Counter()
    for r in s.requests.values():
        assert len(set(r.block_ids)) == len(r.block_ids), "a request owns a block twice"
        owners.update(r.block_ids)
    for b in s.pool.blocks:
        assert b.ref_count == owners[b.block_id], f"block {b.block_id}: ref count != owners"
    assert set(s.pool._free) == {b.block_id for b in s.pool.blocks if b.ref_count == 0}


# ---- async scheduling ----------------------------------------------------------------------

def test_async_scheduling_gives_the_same_outputs_as_sync():
    reqs = [(f"r{i}", prompt(i, 3 + 7 * i), 5 + i) for i in range(10)]
    results = []
    for depth in (1, 2):
        s, w = make(max_num_batched_tokens=16, max_num_seqs=6), FakeWorker(BS)
        for rid, p, m in reqs:
            s.add_request(Request(rid, list(p), m))
        outputs, reasons, _ = drive(s, w, async_depth=depth)
        results.append(outputs)
        assert all(reasons[rid] == FinishReason.LENGTH for rid, _, _ in reqs)
    assert results[0] == results[1]
    for rid, p, m in reqs:
        assert results[1][rid] == solo(p, m)


def test_async_plans_the_next_step_before_the_result_arrives():
    s, w = make(), FakeWorker(BS)
    s.add_request(Request("a", prompt(1, 5), 10))
    first = s.schedule()
    second = s.schedule()            # planned before `first`'s result is known
    [c] = second.cached_requests
    assert c.num_computed_tokens == 5 and c.num_scheduled_tokens == 1
    r1, r2 = w.run(first), w.run(second)   # the worker feeds the token it sampled in `first`
    [o1] = s.update(first, r1)
    [o2] = s.update(second, r2)
    assert o1.new_token_ids + o2.new_token_ids == solo(prompt(1, 5), 2)


def test_a_token_sampled_past_a_stop_is_dropped():
    s, w = make(), FakeWorker(BS)
    s.add_request(Request("a", prompt(2, 6), 20))
    w.forced["a"] = [5, EOS, 42, 43]
    outputs, reasons, _ = drive(s, w, async_depth=2)
    assert outputs["a"] == [5, EOS] and reasons["a"] == FinishReason.STOP
    assert w.plans >= 3  # the worker did run the step past EOS; its token never surfaced


def test_async_never_plans_tokens_past_max_tokens():
    s, w = make(), FakeWorker(BS)
    s.add_request(Request("a", prompt(3, 6), 3))
    _, _, plans = drive(s, w, async_depth=2)
    sampled_steps = sum(1 for p in plans for r in [*p.new_requests, *p.cached_requests] if r.request_id == "a")
    assert sampled_steps == 3


# ---- prefix caching ------------------------------------------------------------------------

def test_a_repeated_prompt_reuses_cached_blocks():
    s, w = make(), FakeWorker(BS)
    p = prompt(4, 18)                                  # 4 full blocks + 2 tokens
    s.add_request(Request("first", list(p), 3))
    drive(s, w)
    s.add_request(Request("again", list(p), 3))
    plan = s.schedule()
    [new] = plan.new_requests
    assert new.num_computed_tokens == 16 and new.num_scheduled_tokens == 2
    assert s.kv.stats.hits == 16 and s.kv.stats.queries == 36
    outputs, _, _ = drive_from(s, w, plan)
    assert outputs["again"] == solo(p, 3)


def drive_from(s, w, plan):
    outs = {}
    for o in s.update(plan, w.run(plan)):
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    more, reasons, plans = drive(s, w)
    for k, v in more.items():
        outs.setdefault(k, []).extend(v)
    return outs, reasons, plans


def test_running_requests_share_prefix_blocks_with_ref_counts():
    s, w = make(), FakeWorker(BS)
    shared = prompt(5, 12)
    s.add_request(Request("a", shared + [1, 2, 3], 30))
    plan = s.schedule()
    s.update(plan, w.run(plan))
    s.add_request(Request("b", shared + [7, 8], 30))
    plan = s.schedule()
    [nb] = plan.new_requests
    assert nb.num_computed_tokens == 12
    a, b = s.requests["a"], s.requests["b"]
    assert a.block_ids[:3] == b.block_ids[:3]
    assert all(s.pool.blocks[i].ref_count == 2 for i in a.block_ids[:3])
    s.update(plan, w.run(plan))
    check_invariants(s)


def test_different_cache_salts_never_share_blocks():
    s, w = make(), FakeWorker(BS)
    p = prompt(6, 17)
    s.add_request(Request("a", list(p), 2, cache_salt="tenant-a"))
    drive(s, w)
    s.add_request(Request("b", list(p), 2, cache_salt="tenant-b"))
    plan = s.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0
    s.update(plan, w.run(plan))
    drive(s, w)
    s.add_request(Request("c", list(p), 2, cache_salt="tenant-a"))
    assert s.schedule().new_requests[0].num_computed_tokens == 16


def test_a_hash_collision_is_not_taken_for_a_hit():
    colliding = lambda parent, tokens, salt: b"same-hash-for-everything"  # noqa: E731
    s, w = make(hash_fn=colliding), FakeWorker(BS)
    s.add_request(Request("a", prompt(7, 17), 4))
    drive(s, w)
    other = prompt(8, 17)
    s.add_request(Request("b", list(other), 4))
    plan = s.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0
    outputs, _, _ = drive_from(s, w, plan)   # the fake KV check would catch a wrong reuse
    assert outputs["b"] == solo(other, 4)


def test_prefix_caching_can_be_disabled():
    s, w = make(enable_prefix_caching=False), FakeWorker(BS)
    p = prompt(9, 17)
    s.add_request(Request("a", list(p), 2))
    drive(s, w)
    s.add_request(Request("b", list(p), 2))
    assert s.schedule().new_requests[0].num_computed_tokens == 0
    assert s.kv.stats.hits == 0


def test_cached_blocks_are_evicted_least_recently_freed_first():
    s, w = make(num_blocks=12), FakeWorker(BS)
    old, new = prompt(10, 17), prompt(11, 17)
    for rid, p in (("old", old), ("new", new)):
        s.add_request(Request(rid, list(p), 2))
        drive(s, w)
    # 12 blocks: a 32-token request needs 9, so some cached blocks must go — the old ones first.
    s.add_request(Request("big", prompt(12, 31), 1))
    drive(s, w)
    s.add_request(Request("new2", list(new), 1))
    s.add_request(Request("old2", list(old), 1))
    plan = s.schedule()
    hits = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
    assert hits["new2"] >= hits["old2"] and hits["new2"] > 0


def test_reset_prefix_cache_flushes_free_blocks_and_keeps_held_ones():
    s, w = make(), FakeWorker(BS)
    done, live = prompt(20, 18), prompt(21, 18)          # 4 full blocks each
    s.add_request(Request("done", list(done), 2))
    drive(s, w)
    s.add_request(Request("live", list(live), 30))
    plan = s.schedule()
    s.update(plan, w.run(plan))                          # "live" runs, its prompt blocks cached
    held = s.requests["live"].block_ids[:4]
    assert all(s.pool.blocks[b].block_hash is not None for b in held)
    cached_free = [b.block_id for b in s.pool.blocks if b.ref_count == 0 and b.block_hash is not None]
    assert len(cached_free) >= 4                         # "done"'s prompt (and output) blocks

    assert s.reset_prefix_cache() == len(cached_free)
    assert all(s.pool.blocks[b].block_hash is None for b in cached_free)
    assert all(s.pool.blocks[b].block_hash is not None for b in held)
    assert s.reset_prefix_cache() == 0                   # nothing left to flush
    check_invariants(s)

    # The finished prompt is computed from scratch; the running one is still shared.
    s.add_request(Request("done-again", list(done), 2))
    s.add_request(Request("live-again", list(live), 2))
    plan = s.schedule()
    hits = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
    assert hits == {"done-again": 0, "live-again": 16}
    outputs, _, _ = drive_from(s, w, plan)
    assert outputs["done-again"] == solo(done, 2)
    check_invariants(s)


def test_abort_returns_blocks_at_once():
    s, w = make(), FakeWorker(BS)
    s.add_request(Request("a", prompt(13, 30), 50))
    plan = s.schedule()
    s.update(plan, w.run(plan))
    assert s.pool.num_free < s.pool.num_blocks
    s.abort(["a"])
    assert s.pool.num_free == s.pool.num_blocks


# ---- priority ------------------------------------------------------------------------------

def test_priority_policy_admits_lower_priority_values_first():
    s, w = make(policy="priority", max_num_seqs=1), FakeWorker(BS)
    for rid, prio in (("low", 5), ("high", -1), ("mid", 2)):
        s.add_request(Request(rid, prompt(len(rid), 5), 2, priority=prio))
    order = []
    def watch(step, sched):
        for r in sched.running:
            if r.request_id not in order:
                order.append(r.request_id)
    drive(s, w, on_step=watch)
    assert order == ["high", "mid", "low"]


def test_priority_preemption_evicts_the_lowest_priority_request():
    s, w = make(policy="priority", num_blocks=8), FakeWorker(BS)
    s.add_request(Request("vip", prompt(1, 8), 12, priority=0))
    s.add_request(Request("bulk", prompt(2, 8), 12, priority=9))
    preempted = []
    def watch(step, sched):
        for r in sched.requests.values():
            if r.num_preemptions and r.request_id not in preempted:
                preempted.append(r.request_id)
    outputs, _, _ = drive(s, w, on_step=watch)
    assert preempted == ["bulk"]
    assert outputs["vip"] == solo(prompt(1, 8), 12) and outputs["bulk"] == solo(prompt(2, 8), 12)


def test_fcfs_preempts_the_latest_admitted():
    s, w = make(num_blocks=8), FakeWorker(BS)
    s.add_request(Request("early", prompt(1, 8), 12))
    s.add_request(Request("late", prompt(2, 8), 12))
    first = []
    def watch(step, sched):
        for r in sched.requests.values():
            if r.num_preemptions and not first:
                first.append(r.request_id)
    drive(s, w, on_step=watch)
    assert first == ["late"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_invalid_policy_and_configs_are_refused(policy):
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=10, policy="random")
    SchedulerConfig(max_model_len=10, policy=policy)


def test_a_request_that_stops_in_its_prefill_step_still_caches_its_prompt():
    s, w = make(), FakeWorker(BS)
    p = prompt(14, 17)
    s.add_request(Request("one-token", list(p), 1))
    drive(s, w)
    s.add_request(Request("again", list(p), 1))
    assert s.schedule().new_requests[0].num_computed_tokens == 16
