"""A stand-in scheduler for worker tests: builds StepPlans (token budget, chunked prefill,
shuffled block ids, preemption by recompute) and feeds them to any `execute(plan)`."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common import pb


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    max_new: int
    sampling: pb.common.SamplingParams
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False
    outputs: list[int] = field(default_factory=list)


class MiniScheduler:
    """Just enough of a scheduler: token budget, chunked prefill, shuffled block ids."""

    def __init__(self, execute: Callable[[pb.step.StepPlan], pb.step.StepResult], block_size: int,
                 num_blocks: int, budget: int, seed: int = 0) -> None:
        self.execute, self.block_size, self.budget = execute, block_size, budget
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.running: list[_Req] = []
        self.finished: list[str] = []
        self.results: dict[str, list[int]] = {}
        self.step_id = 0

    def add(self, rid: str, prompt: list[int], max_new: int, sampling=None) -> None:
        self.running.append(_Req(rid, list(prompt), max_new, sampling or pb.common.SamplingParams()))

    def preempt(self, rid: str) -> None:
        """Recompute-style preemption: drop the worker state and blocks; resend later."""
        r = next(r for r in self.running if r.rid == rid)
        self.free += r.blocks
        r.blocks, r.computed, r.sent = [], 0, False
        self.finished.append(rid)

    def step(self) -> pb.step.StepResult:
        plan = pb.step.StepPlan(step_id=self.step_id, finished_ids=self.finished)
        self.finished = []
        self.step_id += 1
        left, sched = self.budget, []
        for r in self.running:
            n = min(len(r.tokens) - r.computed, left)
            if n <= 0:
                continue
            need = -(-(r.computed + n) // self.block_size) - len(r.blocks)
            new_blocks = [self.free.pop() for _ in range(need)]
            r.blocks += new_blocks
            if not r.sent:
                plan.new_requests.add(request_id=r.rid, token_ids=r.tokens, block_ids=r.blocks,
                                      sampling=r.sampling, num_computed_tokens=r.computed,
                                      num_scheduled_tokens=n, num_output_tokens=len(r.outputs))
                r.sent = True
            else:
                plan.cached_requests.add(request_id=r.rid, new_block_ids=new_blocks,
                                         num_computed_tokens=r.computed, num_scheduled_tokens=n)
            sched.append((r, n))
            left -= n
        result = self.execute(plan)
        assert not result.HasField("error"), result.error.message
        by_id = {o.request_id: o for o in result.outputs}
        assert set(by_id) == {r.rid for r, _ in sched}
        for r, n in sched:
            r.computed += n
            toks = list(by_id[r.rid].token_ids)
            assert len(toks) == (1 if r.computed == len(r.tokens) else 0)
            r.tokens += toks
            r.outputs += toks
            if len(r.outputs) >= r.max_new:
                self.results[r.rid] = r.outputs
                self.running.remove(r)
                self.free += r.blocks
                self.finished.append(r.rid)
        return result

    def run(self) -> dict[str, list[int]]:
        while self.running:
            self.step()
        self.step()  # deliver the last finished_ids
        return self.results
