"""Speculative decoding's part of a runner step (runner.py calls these when --speculative-config
is on): whether to read the previous step before building this one, and each decode row's drafts.

Drafts are proposed from host tokens, and a verified run's pending token sits at no fixed sample
row, so such rows need the previous step read first (a sync) unless the cost model says no draft
would pay this step (SpecDecoder.worth_trying). With tensor parallel both choices are rank 0's
on every rank (runner.tp_spec: tp_ranks.TpLink): they depend on rank-local timings and reads."""
from __future__ import annotations


def read_first(runner, plan) -> bool:
    """Read every submitted step's tokens before this plan is checked and built?"""
    speculates = bool(runner._unresolved) and _needs_previous_step(runner, plan)
    if runner.tp_spec is not None:   # every rank resolves when rank 0 does
        speculates = runner.tp_spec.agree_flag(speculates) and bool(runner._unresolved)
    return speculates


def _needs_previous_step(runner, plan) -> bool:
    budgeted = []
    for r in plan.cached_requests:
        st = runner.requests.get(r.request_id)
        if st is None or not st.num_pending:
            continue
        if st.spec_pending:
            return True
        if r.num_spec_tokens:
            budgeted.append((r.request_id, r.num_spec_tokens))
    if not budgeted:
        return False
    base = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(
        r.num_scheduled_tokens for r in plan.cached_requests)
    return runner.spec.worth_trying(budgeted, base, len(plan.new_requests) + len(plan.cached_requests))


def plan_drafts(runner, scheduled) -> None:
    """Set `drafts` on the step's scheduled rows (runner._Scheduled): rank 0 (or the only rank)
    proposes; with tensor parallel the others take its drafts."""
    runner.spec.acceptance.tick()
    tp = runner.tp_spec
    if tp is None or tp.leader:
        _assign_drafts(runner, scheduled)
    if tp is not None:
        for s, drafts in zip(scheduled, tp.agree_drafts([s.drafts for s in scheduled])):
            s.drafts = drafts


def _assign_drafts(runner, scheduled) -> None:
    """Drafts for the decode rows with a budget (their tokens are all on the host: read_first read
    the previous step), within their block table and the context, cut where a grammar refuses one."""
    rows, by_id = [], {}
    for s in scheduled:
        st = s.state
        if not s.budget or not s.samples or st.num_pending:
            continue
        room = min(s.budget, len(st.block_ids) * runner.block_size - s.end, runner.model.max_model_len - s.end)
        if room > 0:
            rows.append((st.request_id, room))
            by_id[st.request_id] = s
    if not rows:
        return
    base = sum(s.n for s in scheduled)
    for rid, drafts in runner.spec.drafts(rows, base, len(scheduled)).items():
        s = by_id[rid]
        if s.state.matcher is not None:
            drafts = drafts[:runner.constraints.valid_prefix(s.state.matcher, drafts)]
        s.drafts = drafts
