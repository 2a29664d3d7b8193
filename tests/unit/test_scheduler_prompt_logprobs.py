"""The scheduler core and prompt logprobs (vLLM's prompt_logprobs), driven with handmade results:
such a request computes its whole prompt (no prefix-cache hit) yet caches its blocks for others,
and the per-chunk values leave once, whole and in order, with its first token, also after a
preemption restarted its prompt."""
from __future__ import annotations

from dataclasses import replace

from services.scheduler.core import Request, Scheduler, SchedulerConfig

from tests.unit.scheduler_sim import EOS, VOCAB, FakeWorker, drive


class ScoringWorker(FakeWorker):
    """FakeWorker that also scores prompt tokens as the real worker does: the rows of a chunk
    [start, end) of a request with no outputs yet give positions start+1 .. min(end, L-1)."""

    def __init__(self, flagged: set[str], prompt_len: dict[str, int]) -> None:
        super().__init__()
        self.flagged, self.prompt_len = flagged, prompt_len
        self.fresh: set[str] = set()   # requests whose worker state began with no outputs

    def run(self, plan):
        for r in plan.new_requests:
            if r.num_output_tokens == 0:
                self.fresh.add(r.request_id)
            else:
                self.fresh.discard(r.request_id)
        result = super().run(plan)
        spans = {r.request_id: (r.num_computed_tokens, r.num_computed_tokens + r.num_scheduled_tokens)
                 for r in [*plan.new_requests, *plan.cached_requests]}
        out = []
        for s in result.sampled:
            rid = s.request_id
            if rid in self.flagged and rid in self.fresh:
                start, end = spans[rid]
                hi = min(end, self.prompt_len[rid] - 1)
                s = replace(s, prompt_logprobs=[("pos", p) for p in range(start + 1, hi + 1)])
            out.append(s)
        result.sampled = out
        return result


def make(num_blocks=64, **kw) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=256, block_size=4, **kw)
    return Scheduler(cfg, num_blocks, frozenset({EOS}), VOCAB)


PROMPT = [(7 * i + 3) % 900 for i in range(21)]


def test_a_prompt_logprobs_request_gets_no_cached_prefix_but_caches_its_blocks_for_others():
    s = make()
    w = ScoringWorker({"plp"}, {"plp": len(PROMPT)})
    s.add_request(Request("warm", list(PROMPT), 2))
    drive(s, w)
    s.add_request(Request("plp", list(PROMPT), 2, wants_prompt_logprobs=True))
    plan = s.schedule()
    assert [(r.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.new_requests] == [
        ("plp", 0, len(PROMPT))]
    s.update(plan, w.run(plan))
    drive(s, w)

    fresh = make()   # a request asking for prompt logprobs first: the next one reuses its blocks
    w = ScoringWorker({"plp"}, {"plp": len(PROMPT)})
    fresh.add_request(Request("plp", list(PROMPT), 2, wants_prompt_logprobs=True))
    drive(fresh, w)
    fresh.add_request(Request("after", list(PROMPT), 2))
    plan = fresh.schedule()
    assert plan.new_requests[0].num_computed_tokens == 20   # 5 full blocks of 4, from "plp"
    assert fresh.stats()["prefix_cache_queries"] == len(PROMPT)   # "plp" was no cache query


def test_chunked_prompt_logprobs_leave_once_in_order_with_the_first_token():
    s = make(max_num_batched_tokens=6)
    w = ScoringWorker({"plp"}, {"plp": len(PROMPT)})
    s.add_request(Request("plp", list(PROMPT), 4, wants_prompt_logprobs=True))
    s.add_request(Request("plain", list(PROMPT[:9]), 4))
    seen = []
    for _ in range(50):
        if not s.has_work():
            break
        plan = s.schedule()
        for out in s.update(plan, w.run(plan)):
            seen.append((out.request_id, len(out.new_token_ids), out.prompt_logprobs))
    plp = [(n, lps) for rid, n, lps in seen if rid == "plp"]
    assert len(plp) == 4 and all(n == 1 for n, _ in plp)
    assert plp[0][1] == [("pos", p) for p in range(1, len(PROMPT))]   # the first output: all of them
    assert all(not lps for _, lps in plp[1:])
    assert all(not lps for rid, _, lps in seen if rid == "plain")


def test_a_request_preempted_before_its_first_token_sends_its_prompt_logprobs_once():
    # 9 blocks of 4: "hog" decodes and keeps growing while "plp" prefills its 24 tokens in chunks,
    # so blocks run out and the latest request ("plp") is preempted mid-prompt, then resumes.
    s = make(num_blocks=9, max_num_batched_tokens=4)
    prompt = [(5 * i + 1) % 900 for i in range(24)]
    w = ScoringWorker({"plp"}, {"plp": len(prompt)})
    s.add_request(Request("hog", [11, 12, 13, 14, 15, 16, 17, 18], 26, ignore_eos=True))
    plp = Request("plp", prompt, 2, wants_prompt_logprobs=True)
    s.add_request(plp)
    got = []
    preempted_before_first_token = False
    for _ in range(400):
        if not s.has_work():
            break
        before = s.num_preemptions
        plan = s.schedule()
        preempted_before_first_token |= s.num_preemptions > before and not got
        outs = s.update(plan, w.run(plan))
        got += [out.prompt_logprobs for out in outs if out.request_id == "plp" and out.new_token_ids]
    assert preempted_before_first_token and plp.num_preemptions >= 1
    assert got[0] == [("pos", p) for p in range(1, len(prompt))] and [list(g) for g in got[1:]] == [[]]


def test_merged_steps_keep_the_prompt_logprobs_of_the_first_token_output():
    from services.scheduler.core import RequestOutput
    from services.scheduler.server import merge_steps

    first = RequestOutput("a", [5], prompt_logprobs=[("pos", 1), ("pos", 2)])
    out = merge_steps([[first], [RequestOutput("a", [6])], [RequestOutput("a", [7])]])
    assert [(o.new_token_ids, o.prompt_logprobs) for o in out] == [([5, 6, 7], [("pos", 1), ("pos", 2)])]
    assert first.new_token_ids == [5]
