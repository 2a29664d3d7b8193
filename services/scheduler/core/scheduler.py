"""Token-budget continuous batching over a paged KV block pool.

No prefill/decode phases: every request has `num_computed_tokens` and `num_tokens`, and
each step spends `max_num_batched_tokens` and `max_num_seqs`, running requests first, then
waiting ones (FCFS); prompts longer than the remaining budget are chunked. When blocks run
out the latest-admitted running request is preempted by recompute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.request import FinishReason, Request, RequestStatus
from services.scheduler.core.types import (CachedRequestPlan, NewRequestPlan, RequestOutput, StepPlan,
                                           StepResult)


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    max_waiting: int = 65536           # bound on queued requests (admission control)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, eos_token_ids: frozenset[int],
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.pool = BlockPool(num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending_finished_ids: list[str] = []   # worker state to drop in the next plan
        self._pending_outputs: list[RequestOutput] = []  # rejections and aborts, sent with the next step
        self._step_id = 0
        self._arrivals = 0
        self.num_preemptions = 0

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, req: Request) -> str | None:
        """Queue `req`; returns an error message (and queues an error output) if rejected."""
        error = self._validate(req)
        if error is not None:
            self._pending_outputs.append(RequestOutput(
                req.request_id, [], FinishReason.ERROR, "invalid_argument", error,
                num_prompt_tokens=len(req.prompt_token_ids)))
            return error
        if len(self.waiting) >= self.config.max_waiting:
            msg = f"too many queued requests ({self.config.max_waiting})"
            self._pending_outputs.append(RequestOutput(req.request_id, [], FinishReason.ERROR,
                                                       "resource_exhausted", msg))
            return msg
        self._arrivals += 1
        req.arrival_seq = self._arrivals
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return None

    def _validate(self, req: Request) -> str | None:
        cfg = self.config
        n = len(req.prompt_token_ids)
        if req.request_id in self.requests:
            return f"duplicate request id {req.request_id!r}"
        if n == 0:
            return "the prompt is empty"
        if n >= cfg.max_model_len:
            return (f"the prompt has {n} tokens but the model's context length is {cfg.max_model_len}; "
                    "shorten the prompt")
        if self.vocab_size is not None:
            bad = next((t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return f"token id {bad} is out of range [0, {self.vocab_size})"
        if req.max_tokens <= 0:
            req.max_tokens = cfg.max_model_len - n
        if req.min_tokens < 0 or req.min_tokens > req.max_tokens:
            return f"min_tokens ({req.min_tokens}) must be between 0 and max_tokens ({req.max_tokens})"
        if self._blocks_for(min(n + req.max_tokens, cfg.max_model_len)) > self.pool.num_blocks:
            # It could never run to completion even alone: better to say so now.
            return (f"prompt + max_tokens needs more KV cache than the engine has "
                    f"({self.pool.num_blocks} blocks of {cfg.block_size} tokens)")
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                self._pending_outputs.append(RequestOutput(rid, [], FinishReason.ABORT,
                                                           num_prompt_tokens=len(req.prompt_token_ids)))

    # ---- state --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._pending_finished_ids or self._pending_outputs)

    def take_pending_outputs(self) -> list[RequestOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

    # ---- planning -----------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        need = self._blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.block_ids.extend(got)
        return True

    def _preempt(self, victim: Request) -> None:
        """Recompute-style preemption: drop its KV, requeue it at the front."""
        self.running.remove(victim)
        self.pool.free(victim.block_ids)
        victim.block_ids = []
        victim.num_blocks_sent = 0
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if victim.worker_has_state:
            self._pending_finished_ids.append(victim.request_id)
            victim.worker_has_state = False
        self.waiting.appendleft(victim)

    def schedule(self) -> StepPlan:
        self._step_id += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        # Running requests first, oldest first; the newest is preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self._ensure_blocks(req, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        # Then waiting requests, FCFS, while budgets last (not in a step that had to preempt).
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._ensure_blocks(req, req.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        plan = StepPlan(self._step_id, finished_ids=self._pending_finished_ids)
        self._pending_finished_ids = []
        for req, num_new in scheduled:
            if not req.worker_has_state:
                plan.new_requests.append(NewRequestPlan(
                    req.request_id, req.all_token_ids, list(req.block_ids), req.sampling,
                    req.num_computed_tokens, num_new, len(req.output_token_ids), req.trace))
                req.worker_has_state = True
            else:
                plan.cached_requests.append(CachedRequestPlan(
                    req.request_id, req.block_ids[req.num_blocks_sent:], req.num_computed_tokens, num_new))
            req.num_blocks_sent = len(req.block_ids)
        return plan

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        outputs = self.take_pending_outputs()
        scheduled = {r.request_id: r.num_scheduled_tokens for r in plan.new_requests}
        scheduled.update({r.request_id: r.num_scheduled_tokens for r in plan.cached_requests})
        if result.error is not None:
            for rid in scheduled:
                req = self.requests.get(rid)
                if req is not None and req.status is RequestStatus.RUNNING:
                    self._finish(req, FinishReason.ERROR)
                    outputs.append(RequestOutput(rid, [], FinishReason.ERROR, "internal",
                                                 f"the worker failed the step: {result.error}",
                                                 num_prompt_tokens=len(req.prompt_token_ids)))
            return outputs

        sampled = {s.request_id: s for s in result.sampled}
        for rid, num_new in scheduled.items():
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran: its tokens are dropped
            req.num_computed_tokens += num_new
            s = sampled.get(rid)
            if s is None or not s.token_ids:
                continue  # a prompt chunk that does not reach the end of the prompt
            new_ids: list[int] = []
            reason = None
            stop_id = -1
            for tok in s.token_ids:
                req.output_token_ids.append(tok)
                new_ids.append(tok)
                reason = req.check_stop(tok, self.eos_token_ids, self.config.max_model_len)
                if reason is not None:
                    stop_id = tok if reason == FinishReason.STOP else -1
                    break
            out = RequestOutput(rid, new_ids, reason, logprobs=list(s.logprobs or []),
                                num_prompt_tokens=len(req.prompt_token_ids), stop_token_id=stop_id)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(out)
        return outputs

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """Finish every request with an error (the worker lost its state)."""
        outputs = self.take_pending_outputs()
        for req in list(self.requests.values()):
            outputs.append(RequestOutput(req.request_id, [], FinishReason.ERROR, code, message,
                                         num_prompt_tokens=len(req.prompt_token_ids)))
            self._finish(req, FinishReason.ERROR)
        self._pending_finished_ids = []  # the worker that held them is gone
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        if req.worker_has_state:
            self._pending_finished_ids.append(req.request_id)
            req.worker_has_state = False
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]
