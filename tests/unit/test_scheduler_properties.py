"""Property-based tests of the scheduler core over random arrivals, lengths, aborts, block
counts, policies and async depth: blocks are never owned twice, ref counts match owners,
every block comes back, nobody waits forever, and outputs equal each request's solo output."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import FinishReason, Request, Scheduler, SchedulerConfig
from tests.unit.scheduler_sim import EOS, VOCAB, Driver, FakeWorker
from tests.unit.test_scheduler_features import BS, check_invariants, solo

PREFIXES = [[(i * 13 + k) % 900 for k in range(12)] for i in range(3)]

request_spec = st.fixed_dictionaries({
    "prefix": st.sampled_from([None, 0, 1, 2]),           # shared prefixes exercise the prefix cache
    "suffix_len": st.integers(1, 20),
    "max_tokens": st.integers(1, 12),
    "salt": st.sampled_from(["", "", "x"]),
    "priority": st.integers(0, 3),
    "arrive_at": st.integers(0, 30),                        # step at which it is submitted
    "abort_at": st.one_of(st.none(), st.integers(0, 60)),   # step at which it is aborted, if ever
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=12), num_blocks=st.integers(9, 40),
       budget=st.sampled_from([4, 7, 16, 64]), max_seqs=st.integers(1, 6),
       policy=st.sampled_from(["fcfs", "priority"]), depth=st.sampled_from([1, 2]),
       prefix_caching=st.booleans())
def test_scheduler_invariants_hold_under_random_workloads(specs, num_blocks, budget, max_seqs, policy, depth,
                                                          prefix_caching):
    cfg = SchedulerConfig(max_model_len=128, block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          policy=policy, enable_prefix_caching=prefix_caching)
    s, w = Scheduler(cfg, num_blocks, frozenset({EOS}), VOCAB), FakeWorker(BS)
    prompts = {}
    for i, spec in enumerate(specs):
        p = (PREFIXES[spec["prefix"]] if spec["prefix"] is not None else []) + \
            [(i * 7 + k * 3) % 900 for k in range(spec["suffix_len"])]
        prompts[f"r{i}"] = (p, spec)
    rejected, aborted = set(), set()

    def on_step(step, sched):
        check_invariants(sched)
        for rid, (p, spec) in prompts.items():
            if spec["arrive_at"] == step:
                err = sched.add_request(Request(rid, list(p), spec["max_tokens"], cache_salt=spec["salt"],
                                                priority=spec["priority"]))
                if err is not None:
                    rejected.add(rid)
            if spec["abort_at"] == step and spec["arrive_at"] <= step and rid in sched.requests:
                sched.abort([rid])
                aborted.add(rid)

    d = Driver(s, w, depth)
    step = 0
    while step <= 31 or d.busy:
        on_step(step, s)
        d.step()
        step += 1
        assert step < 5000, "the scheduler did not drain: a request waits forever"
    outputs, reasons = d.outputs, d.reasons
    for plan in d.plans:
        assert plan.num_scheduled_tokens <= budget, "the token budget was exceeded"
        assert len(plan.scheduled_ids) <= max_seqs, "max_num_seqs was exceeded"
    check_invariants(s)
    assert s.pool.num_free == s.pool.num_blocks, "blocks did not all come back"
    assert not s.requests
    for rid, (p, spec) in prompts.items():
        if rid in rejected or rid in aborted:
            continue
        assert reasons.get(rid) == FinishReason.LENGTH, (rid, reasons.get(rid))
        assert outputs[rid] == solo(p, spec["max_tokens"]), f"{rid} output differs from its solo run"
