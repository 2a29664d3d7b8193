"""A stand-in worker for driving the scheduler core on the CPU (the boundary we simulate).

It keeps token lists from the plan diffs like the real worker, and a fake KV cache: every
position a step computes is written into its slot, and every position a request attends to
is checked to hold that request's own token. Shared or reused blocks that hold the wrong
tokens (a prefix-cache or ref-count bug) therefore fail loudly."""
from __future__ import annotations

from collections import deque

from services.scheduler.core import SampledTokens, StepResult

VOCAB = 1000
EOS = 999


def next_token(history: list[int]) -> int:
    """A deterministic stand-in for a model: the next token depends on the whole history."""
    h = 7
    for t in history:
        h = (h * 31 + t) % 998_244_353
    return h % (VOCAB - 1)  # never EOS unless a test forces it


class FakeWorker:
    def __init__(self, block_size: int = 4) -> None:
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.forced: dict[str, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.plans = 0

    def _slot(self, rid: str, pos: int) -> tuple[int, int]:
        return self.blocks[rid][pos // self.block_size], pos % self.block_size

    def run(self, plan) -> StepResult:
        self.plans += 1
        for rid in plan.finished_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        sampled = []
        for r in plan.new_requests:
            assert r.request_id not in self.tokens, "a new request the worker already holds"
            self.tokens[r.request_id] = list(r.token_ids)
            self.blocks[r.request_id] = list(r.block_ids)
        for r in plan.cached_requests:
            assert r.request_id in self.tokens, "a cached request the worker does not hold"
            self.blocks[r.request_id].extend(r.new_block_ids)
        for r in [*plan.new_requests, *plan.cached_requests]:
            rid = r.request_id
            toks = self.tokens[rid]
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_scheduled_tokens
            assert 0 < r.num_scheduled_tokens and end <= len(toks), "scheduled tokens the worker does not know"
            assert len(self.blocks[rid]) * self.block_size >= end, "KV blocks do not cover the scheduled tokens"
            for pos in range(start, end):
                b, s = self._slot(rid, pos)
                self.kv.setdefault(b, [None] * self.block_size)[s] = toks[pos]
            for pos in range(end):
                b, s = self._slot(rid, pos)
                assert self.kv.get(b, [None] * self.block_size)[s] == toks[pos], \
                    f"{rid}: KV slot for position {pos} holds another token"
            if end == len(toks):
                forced = self.forced.get(rid)
                tok = forced.pop(0) if forced else next_token(toks)
                toks.append(tok)
                sampled.append(SampledTokens(rid, [tok]))
            else:
                sampled.append(SampledTokens(rid, []))
        return StepResult(plan.step_id, sampled)


class Driver:
    """Steps the scheduler like the adapter does, with `async_depth` plans in flight."""

    def __init__(self, s, worker: FakeWorker, async_depth: int = 1) -> None:
        self.s, self.worker, self.depth = s, worker, async_depth
        self.inflight: deque = deque()
        self.outputs: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.plans: list = []

    def _collect(self, outs) -> None:
        for out in outs:
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                self.reasons[out.request_id] = out.finish_reason

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or self.s.has_work()

    def step(self) -> None:
        s = self.s
        if len(self.inflight) < self.depth and s.has_work():
            plan = s.schedule()
            # With kvstore fetches under way an empty plan still goes: its result reports them.
            if not plan.is_empty() or ((s.loading or s.handoffs) and not self.inflight):
                self.plans.append(plan)
                self.inflight.append((plan, self.worker.run(plan)))  # the worker runs plans in order
                if len(self.inflight) < self.depth:
                    return
            else:
                self._collect(s.take_pending_outputs())
        if self.inflight:
            plan, result = self.inflight.popleft()
            self._collect(s.update(plan, result))


def drive(s, worker: FakeWorker, *, async_depth: int = 1, max_steps: int = 20_000, on_step=None):
    """Run the scheduler to completion. Returns (outputs per request, finish reasons, plans)."""
    d = Driver(s, worker, async_depth)
    for step in range(max_steps):
        if on_step is not None:
            on_step(step, s)
        if not d.busy:
            break
        d.step()
    return d.outputs, d.reasons, d.plans
