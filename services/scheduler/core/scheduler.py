"""Token-budget continuous batching over a paged KV block pool with prefix caching.

No prefill/decode phases: every request has `num_computed_tokens` and `num_tokens`, and each
step spends `max_num_batched_tokens` and `max_num_seqs`, running requests first, then waiting
ones; prompts longer than the remaining budget are chunked, so decodes never stall behind them.
When blocks run out, the latest (FCFS) or lowest-priority request is preempted by recompute.

Async scheduling: `num_computed_tokens` advances when a step is planned, and a planned step
that reaches the end of a request's known tokens counts one in-flight token. The next step can
therefore be planned before the previous result arrives: the worker feeds the token it sampled
itself. A token sampled after a request stopped is dropped in `update`.

Submits arrive validated (EngineSubmit's contract, engine.proto): the gateway's sampling
rulebook (services/common/sampling_rules.py) resolved max_tokens (>= 1) and checked
min_tokens <= max_tokens, so the core neither fills in nor re-checks them; a max_tokens < 1 is
a malformed submit and refused. It checks only what the engine alone can vouch for: the prompt
against its own context and vocabulary, and whether the request fits its KV cache."""
from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.core.kv_cache_manager import HashFn, KVCacheManager, chained_block_hash
from services.scheduler.core.request import FinishReason, Request, RequestStatus
from services.scheduler.core.types import (CachedRequestPlan, NewRequestPlan, RequestOutput, StepPlan,
                                           StepResult, TierBlocks)
from services.scheduler.core.waiting_queue import make_waiting_queue


SPEC_PROBE_AFTER = 4   # budgeted decode steps without drafts before a request gets one probe slot


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    max_waiting: int = 65536           # bound on queued requests (admission control)
    policy: str = "fcfs"               # "fcfs" or "priority"
    enable_prefix_caching: bool = True
    num_spec_tokens: int = 0           # speculative decoding: most draft tokens per decode step (0: off)
    kv_tier: bool = False              # a kvstore (tier 2): look prompts up, fetch and save blocks
    # A hand-off (docs/pd.md) whose blocks do not all arrive: recompute them, or fail the request.
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy must be recompute or fail, got {self.kv_load_failure_policy!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, eos_token_ids: frozenset[int],
                 vocab_size: int | None = None, hash_fn: HashFn = chained_block_hash,
                 num_host_blocks: int = 0, export_addr: str = "") -> None:
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, hash_fn,
                                 num_host_blocks)
        self.kv_tier = config.kv_tier and config.enable_prefix_caching
        self.pool = self.kv.pool
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self._pending_finished_ids: list[str] = []       # worker state to drop in the next plan
        self._pending_outputs: list[RequestOutput] = []  # rejections and aborts, sent with the next step
        self._step_id = 0
        self._arrivals = 0
        self.num_preemptions = 0
        # KV tiers (docs/kv_tiers.md). Requests asking the kvstore how much of their prompt it
        # holds (the adapter sends lookup_outbox and answers with on_tier_lookup), and requests
        # whose blocks are filling from it (the worker reports in StepResult.kv_loads).
        self.lookups: dict[str, Request] = {}
        self.lookup_outbox: list[tuple[str, list[bytes]]] = []
        self.loading: dict[str, Request] = {}
        self.handoffs: dict[str, Request] = {}   # prefill-only, first token out, saves not all reported
        # Direct hand-offs (docs/pd.md): this engine's worker exports its cache at export_addr;
        # a prefill-only request's blocks are held under a lease until released (release()).
        self.export_addr = export_addr
        self.leases: dict[str, Request] = {}
        self.tier_stats = {"host_hit_blocks": 0, "kvstore_lookups": 0, "kvstore_found_blocks": 0,
                           "kvstore_loaded_blocks": 0, "kvstore_failed_blocks": 0, "kvstore_saved_blocks": 0,
                           # direct hand-offs that did not arrive whole, by what followed
                           "direct_failed_kvstore": 0, "direct_failed_recompute": 0, "direct_failed_error": 0}

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
        self.requests[req.request_id] = req
        if req.handoff and req.kv_tier_blocks >= 0:
            pass   # a hand-off names its blocks: no lookup (docs/pd.md)
        elif self.kv_tier and not req.wants_prompt_logprobs:
            hashes = self.kv.prompt_hashes(req)
            if hashes and self.kv.local_prefix_blocks(req) < len(hashes):
                # More of the prompt than this engine holds: ask the kvstore first (not queued).
                req.status = RequestStatus.LOOKUP
                self.lookups[req.request_id] = req
                self.lookup_outbox.append((req.request_id, hashes))
                self.tier_stats["kvstore_lookups"] += 1
                return None
        req.status = RequestStatus.WAITING
        self.waiting.add(req)
        return None

    def take_lookups(self) -> list[tuple[str, list[bytes]]]:
        """kvstore lookups to send: (request id, its prompt's hash chain)."""
        out, self.lookup_outbox = self.lookup_outbox, []
        return out

    def on_tier_lookup(self, request_id: str, num_found: int) -> None:
        """The kvstore holds the first `num_found` blocks of the chain (0 when it could not say):
        the request joins the waiting queue."""
        req = self.lookups.pop(request_id, None)
        if req is None:
            return   # finished (aborted) meanwhile
        req.kv_tier_blocks = max(0, num_found)
        self.tier_stats["kvstore_found_blocks"] += req.kv_tier_blocks
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

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
            bad = next((t for t in req.all_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return f"token id {bad} is out of range [0, {self.vocab_size})"
        if req.max_tokens < 1:
            return f"malformed submit: max_tokens must be resolved to at least 1, got {req.max_tokens}"
        if len(req.output_token_ids) >= req.max_tokens:
            return f"malformed hand-off: {len(req.output_token_ids)} tokens already sampled of max_tokens {req.max_tokens}"
        # +1: with async scheduling a request may hold a slot for one token past its stop.
        if self.kv.blocks_for(min(n + req.max_tokens + 1, cfg.max_model_len)) > self.pool.num_blocks:
            # It could never run to completion even alone: better to say so now.
            return (f"prompt + max_tokens needs more KV cache than the engine has "
                    f"({self.pool.num_blocks} blocks of {cfg.block_size} tokens)")
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            released = rid in self.leases   # a direct hand-off's lease: its hand-off output was the last
            self._finish(req)
            if not released:
                self._pending_outputs.append(RequestOutput(rid, [], FinishReason.ABORT,
                                                           num_prompt_tokens=len(req.prompt_token_ids)))

    # ---- state --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.lookups) + len(self.loading)

    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting) or self._pending_finished_ids or self._pending_outputs
                    or self.loading or self.handoffs)

    def take_pending_outputs(self) -> list[RequestOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

    # ---- planning -----------------------------------------------------------------------
    def _may_grow(self, req: Request) -> bool:
        """False once the tokens already planned reach max_tokens or the context length."""
        if req.num_computed_tokens < req.num_tokens:
            return True  # prompt (or resumed) tokens still to compute
        n_out = len(req.output_token_ids) + req.num_inflight_tokens
        return n_out < req.max_tokens and req.num_planned_tokens < self.config.max_model_len

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_seq))
        return self.running[-1]

    def _preempt(self, victim: Request) -> None:
        """Recompute-style preemption: drop its KV (cached blocks stay cached), requeue it."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_blocks_sent = 0
        victim.num_computed_tokens = 0
        victim.num_inflight_tokens = 0
        victim.spec_slack = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        if not victim.output_token_ids:
            victim.prompt_logprobs = []   # its prompt runs again from the start
        self.num_preemptions += 1
        if victim.worker_has_state:
            self._pending_finished_ids.append(victim.request_id)
            victim.worker_has_state = False
        self.waiting.requeue(victim)

    def _spec_budget(self, req: Request, num_new: int, budget: int) -> int:
        """Draft tokens the worker may verify after this decode token: none for prompt chunks;
        num_spec_tokens, but once the worker drafted none for SPEC_PROBE_AFTER budgeted steps in
        a row (nothing to propose, or not worth it), only every SPEC_PROBE_AFTER-th step (so an
        engine whose speculation does not pay keeps a quarter of the slots); within max_tokens,
        the context and this step's budget."""
        k_max = self.config.num_spec_tokens
        if not k_max or num_new != 1 or req.num_computed_tokens + 1 != req.num_planned_tokens:
            return 0
        end = req.num_computed_tokens + 1 + req.spec_slack          # a bound on the worker's position
        out_room = req.max_tokens - len(req.output_token_ids) - req.num_inflight_tokens - 1
        if req.spec_declined >= SPEC_PROBE_AFTER and req.spec_declined % SPEC_PROBE_AFTER:
            req.spec_declined += 1   # a step without a budget counts towards the next probe
            return 0
        return max(0, min(k_max, out_room, self.config.max_model_len - end, budget - 1))

    def schedule(self) -> StepPlan:
        self._step_id += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[int, tuple[Request, int, int]] = {}   # id(req) -> (req, tokens, draft budget)
        preempted = False

        # Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            planned = len(req.all_token_ids) + req.num_inflight_tokens
            num_new = min(planned - req.num_computed_tokens, budget)
            if num_new <= 0 or not self._may_grow(req):
                i += 1
                continue
            spec = self._spec_budget(req, num_new, budget)
            if spec and not self.kv.allocate(req, req.num_computed_tokens + num_new + spec + req.spec_slack):
                spec = 0   # no room for lookahead slots: a plain decode step
            while not self.kv.allocate(req, req.num_computed_tokens + num_new + req.spec_slack):
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # an earlier request leaves the list: `req` moves down one
                undone = scheduled.pop(id(victim), None)
                if undone is not None:
                    budget += undone[1] + undone[2]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # `req` itself was preempted; `i` already points at the next one
            scheduled[id(req)] = (req, num_new, spec)
            budget -= num_new + spec
            i += 1

        # Then waiting requests while budgets last (never in a step that had to preempt).
        host_loads: list[tuple[int, int]] = []
        tier_loads: list[TierBlocks] = []
        while (not preempted and len(self.waiting) and budget > 0
               and len(self.running) + len(self.loading) < cfg.max_num_seqs):
            req = self.waiting.peek()
            # Prompt logprobs need every prompt row's logits: no cached prefix (as vLLM), though
            # the blocks it fills are cached for others; nor is it counted as a cache query.
            if req.wants_prompt_logprobs:
                cached, slots = [], []
            else:
                cached = self.kv.find_cached_prefix(req)
                slots = self.kv.find_host_prefix(req, len(cached))   # tier 1, after the device's
            local = len(cached) + len(slots)
            num_tier = (max(0, req.kv_tier_blocks - local) if (self.kv_tier or req.peer) and not req.wants_prompt_logprobs
                        else 0)
            if num_tier:
                # Tier 2: its blocks fill in the background; it runs once the worker reports.
                if not self.kv.allocate(req, (local + num_tier) * cfg.block_size, cached):
                    break
                self.waiting.pop()
                self._count_admission(req, len(cached), len(slots))
                host_loads.extend(zip(req.block_ids[len(cached):local], slots))
                ids = req.block_ids[local:local + num_tier]
                tier_loads.append(TierBlocks(req.request_id, ids, req.block_hashes[local:local + num_tier], req.peer,
                                             req.src_block_ids[local:local + num_tier] if req.peer else [],
                                             req.lease_deadline_ns))
                req.tier_load = (local, num_tier)
                req.kv_tier_blocks = -1   # asked again if it is ever preempted
                req.status = RequestStatus.LOADING
                self.loading[req.request_id] = req
                continue
            num_computed = local * cfg.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if not self.kv.allocate(req, num_computed + num_new, cached):
                break
            self.waiting.pop()
            self._count_admission(req, len(cached), len(slots))
            host_loads.extend(zip(req.block_ids[len(cached):local], slots))
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[id(req)] = (req, num_new, 0)
            budget -= num_new

        plan = StepPlan(self._step_id, finished_ids=self._pending_finished_ids,
                        host_offloads=self.kv.take_offloads(), host_loads=host_loads, tier_loads=tier_loads)
        self._pending_finished_ids = []
        for req, num_new, spec in scheduled.values():
            if not req.worker_has_state:
                plan.new_requests.append(NewRequestPlan(
                    req.request_id, list(req.all_token_ids), list(req.block_ids), req.sampling,
                    req.num_computed_tokens, num_new, len(req.output_token_ids), req.trace))
                req.worker_has_state = True
            else:
                plan.cached_requests.append(CachedRequestPlan(
                    req.request_id, req.block_ids[req.num_blocks_sent:], req.num_computed_tokens, num_new, spec))
                req.spec_slack += spec
            req.num_blocks_sent = len(req.block_ids)
            plan.incarnations[req.request_id] = (req.arrival_seq, req.num_preemptions)
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_planned_tokens:
                req.num_inflight_tokens += 1   # this step samples a token
            if self.kv_tier:   # direct hand-offs too: the decode side's fallback (_direct_to_kvstore)
                self._plan_save(plan, req)
        return plan

    def _count_admission(self, req: Request, num_device: int, num_host: int) -> None:
        if not req.wants_prompt_logprobs:
            self.kv.stats.queries += req.num_tokens
            self.kv.stats.hits += num_device * self.config.block_size
        self.tier_stats["host_hit_blocks"] += num_host
        if req.num_preemptions == 0:
            req.num_cached_prompt_tokens = (num_device + num_host) * self.config.block_size
        if not req.prefill_only:   # a hand-off saves every block: the decode engine fetches them all
            req.num_saved_blocks = max(req.num_saved_blocks, num_device + num_host)

    def _plan_save(self, plan: StepPlan, req: Request) -> None:
        """Full prompt blocks this step completes go to the kvstore after its forward (once)."""
        full = min(req.num_computed_tokens, len(req.prompt_token_ids)) // self.config.block_size
        if full <= req.num_saved_blocks:
            return
        start = req.num_saved_blocks
        hashes = self.kv._block_hashes(req, full)
        plan.tier_saves.append(TierBlocks(req.request_id, req.block_ids[start:full], hashes[start:full]))
        self.tier_stats["kvstore_saved_blocks"] += full - start
        req.num_saved_blocks = full
        req.pending_saves += 1

    def _on_kv_loads(self, results) -> None:
        """Ended kvstore fetches: the loaded prefix counts as computed, the rest is recomputed."""
        bs = self.config.block_size
        for r in results:
            req = self.loading.pop(r.request_id, None)
            if req is None:
                continue
            if req.dropped:   # finished while its blocks filled: they are free only now
                self.kv.free(req)
                continue
            start, count = req.tier_load
            ok = max(0, min(r.num_loaded, count))
            if req.peer and ok < count and self.kv_tier and not req.wants_prompt_logprobs:
                self._direct_to_kvstore(req)
                continue
            self.tier_stats["kvstore_loaded_blocks"] += ok
            self.tier_stats["kvstore_failed_blocks"] += count - ok
            fail = ok < count and req.handoff and self.config.kv_load_failure_policy == "fail"
            if req.peer and ok < count:
                self.tier_stats["direct_failed_error" if fail else "direct_failed_recompute"] += 1
            if fail:
                self.requests.pop(req.request_id, None)
                req.status = RequestStatus.FINISHED
                self.kv.free(req)
                self._pending_outputs.append(RequestOutput(
                    req.request_id, [], FinishReason.ERROR, "unavailable",
                    f"the prefilled KV did not arrive ({ok} of {count} blocks) and "
                    "--kv-load-failure-policy is fail", num_prompt_tokens=len(req.prompt_token_ids)))
                continue
            if not req.prefill_only:
                req.num_saved_blocks = max(req.num_saved_blocks, start + ok)
            req.num_computed_tokens = (start + ok) * bs
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _direct_to_kvstore(self, req: Request) -> None:
        """A direct hand-off that did not arrive whole (the peer unreachable, its lease over):
        what the prefill engine saved to the kvstore is looked up there instead (docs/pd.md),
        and what is not found there is recomputed. Its blocks are dropped (none is cached yet)
        and it starts over as a lookup, as a preempted request would."""
        self.tier_stats["direct_failed_kvstore"] += 1
        self.kv.free(req)
        req.num_blocks_sent = 0
        req.num_computed_tokens = 0
        req.peer, req.src_block_ids, req.lease_deadline_ns = "", [], 0
        req.kv_tier_blocks = -1
        if req.worker_has_state:
            self._pending_finished_ids.append(req.request_id)
            req.worker_has_state = False
        req.status = RequestStatus.LOOKUP
        self.lookups[req.request_id] = req
        self.lookup_outbox.append((req.request_id, self.kv.prompt_hashes(req)))
        self.tier_stats["kvstore_lookups"] += 1

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        if result.kv_loads:
            self._on_kv_loads(result.kv_loads)
        if result.kv_saves:
            self._on_kv_saves(result.kv_saves)
        outputs = self.take_pending_outputs()
        sampled = {s.request_id: s for s in result.sampled}
        requests, incarnations = self.requests, plan.incarnations
        running = RequestStatus.RUNNING
        block_size = self.config.block_size
        for r in (*plan.new_requests, *plan.cached_requests):
            rid = r.request_id
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue  # finished, aborted or preempted after this step was planned: drop
            if (req.arrival_seq, req.num_preemptions) != incarnations.get(rid):
                continue  # planned for an earlier incarnation of this request
            if result.error is not None:
                self._finish(req)
                outputs.append(RequestOutput(rid, [], FinishReason.ERROR, "internal",
                                             f"the worker failed the step: {result.error}",
                                             num_prompt_tokens=len(req.prompt_token_ids)))
                continue
            s = sampled.get(rid)
            spec = getattr(r, "num_spec_tokens", 0)
            if spec:   # speculative decoding: accepted drafts were computed too
                req.spec_slack -= spec
                if s is not None and s.token_ids:
                    req.spec_declined = 0 if s.num_draft_tokens else req.spec_declined + 1
                    accepted = len(s.token_ids) - 1
                    if s.num_draft_tokens:
                        req.spec_drafted += s.num_draft_tokens
                        req.spec_accepted += accepted
                    req.num_computed_tokens += accepted
                    out = self._append_tokens(req, s, finish=False)
                    # Only blocks made of accepted tokens are cached (a rejected draft's slot is
                    # past the last token and is written again).
                    end = min(r.num_computed_tokens + 1 + accepted, req.num_tokens - 1)
                    if end // block_size > req.num_cached_blocks:
                        self.kv.cache_computed_blocks(req, end)
                    outputs.append(out)
                    if out.finish_reason is not None:
                        self._finish(req)
                    continue
            # Cache the blocks this step filled before a stop can release them.
            computed_end = r.num_computed_tokens + r.num_scheduled_tokens
            if computed_end // block_size > req.num_cached_blocks:
                self.kv.cache_computed_blocks(req, computed_end)
            if s is None:
                continue
            if req.wants_prompt_logprobs and s.prompt_logprobs:
                req.prompt_logprobs.extend(s.prompt_logprobs)
            if s.token_ids:
                out = self._append_tokens(req, s)
                outputs.append(out)
                if req.prefill_only and out.finish_reason is None:
                    self._to_handoff(req, outputs)
        return outputs

    # ---- prefill/decode hand-off (docs/pd.md) ---------------------------------------------
    def _to_handoff(self, req: Request, outputs: list[RequestOutput]) -> None:
        """A prefill-only request's first token is out: it runs no more here and ends once the
        saves of its prompt blocks all reported (its blocks stay held until then)."""
        self.running.remove(req)
        req.status = RequestStatus.HANDOFF
        if self.export_addr:
            # Direct: its blocks stay here, under a lease, until the decode side has copied them.
            n = (len(req.prompt_token_ids) - 1) // self.config.block_size
            self.leases[req.request_id] = req
            outputs.append(RequestOutput(req.request_id, [], FinishReason.LENGTH,
                                         num_prompt_tokens=len(req.prompt_token_ids),
                                         num_cached_tokens=req.num_cached_prompt_tokens, handoff_blocks=n,
                                         handoff_peer=self.export_addr, handoff_block_ids=req.block_ids[:n]))
            return
        self.handoffs[req.request_id] = req
        if not req.pending_saves:
            self._end_handoff(req, outputs)

    def _end_handoff(self, req: Request, outputs: list[RequestOutput]) -> None:
        del self.handoffs[req.request_id]
        outputs.append(RequestOutput(req.request_id, [], FinishReason.LENGTH,
                                     num_prompt_tokens=len(req.prompt_token_ids),
                                     num_cached_tokens=req.num_cached_prompt_tokens,
                                     handoff_blocks=req.saved_blocks))
        self._finish(req)

    def _on_kv_saves(self, results) -> None:
        for r in results:
            req = self.requests.get(r.request_id)
            if req is None or not req.prefill_only or req.pending_saves <= 0:
                continue
            req.pending_saves -= 1
            if r.num_saved < r.num_blocks:
                req.saves_broken = True
            elif not req.saves_broken:
                req.saved_blocks += r.num_blocks
            if not req.pending_saves and req.request_id in self.handoffs:   # not a direct one's lease
                self._end_handoff(req, self._pending_outputs)

    def _append_tokens(self, req: Request, s, finish: bool = True) -> RequestOutput:
        """Append one step's tokens (one, or a speculative step's accepted drafts and one more),
        up to the first that stops the request; the rest are dropped."""
        new_ids: list[int] = []
        reason = None
        stop_id = -1
        eos, max_len = self.eos_token_ids, self.config.max_model_len
        if req.num_inflight_tokens:
            req.num_inflight_tokens -= 1   # one sampled token was counted in flight for the step
        for tok in s.token_ids:
            req.append_output(tok)
            new_ids.append(tok)
            reason = req.check_stop(tok, eos, max_len)
            if reason is not None:
                stop_id = tok if reason == FinishReason.STOP else -1
                break
        out = RequestOutput(req.request_id, new_ids, reason,
                            logprobs=list(s.logprobs)[:len(new_ids)] if s.logprobs else [],
                            num_prompt_tokens=len(req.prompt_token_ids),
                            num_cached_tokens=req.num_cached_prompt_tokens, stop_token_id=stop_id)
        if req.prompt_logprobs:   # the first token: the prompt's logprobs go with it, once
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
        if reason is not None:
            out.spec_draft_tokens, out.spec_accepted_tokens = req.spec_drafted, req.spec_accepted
            if finish:
                self._finish(req)
        return out

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """Finish every request with an error (the worker lost its state)."""
        outputs = self.take_pending_outputs()
        for req in list(self.requests.values()):
            outputs.append(RequestOutput(req.request_id, [], FinishReason.ERROR, code, message,
                                         num_prompt_tokens=len(req.prompt_token_ids)))
            self._finish(req)
        self._pending_finished_ids = []  # the worker that held them is gone
        for req in self.loading.values():   # its fetches ended with it
            self.kv.free(req)
        self.loading.clear()
        self.handoffs.clear()
        self.leases.clear()
        return outputs

    def _finish(self, req: Request) -> None:
        """Release everything at once: blocks go back to the pool (cached ones stay cached)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.LOOKUP:
            del self.lookups[req.request_id]
        elif req.status is RequestStatus.HANDOFF:
            self.handoffs.pop(req.request_id, None)
            self.leases.pop(req.request_id, None)
        if req.status is RequestStatus.LOADING:
            req.dropped = True   # the worker writes its blocks until it reports the fetch
        else:
            self.kv.free(req)
        if req.worker_has_state:
            self._pending_finished_ids.append(req.request_id)
            req.worker_has_state = False
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]

    def reset_prefix_cache(self, tiers: bool = False) -> int:
        """Flush the prefix cache of unused blocks (see KVCacheManager.reset_prefix_cache), and
        with `tiers` tier 1's index too (the adapter flushes the kvstore). Call it between
        steps, never while a plan is being built; returns the device blocks flushed."""
        if tiers and self.kv.host is not None:
            self.kv.host.reset()
        return self.kv.reset_prefix_cache()

    # ---- metrics ------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Engine state for metrics: counts, KV usage and prefix-cache counters."""
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "kv_usage": self.pool.usage,
                "prefix_cache_queries": self.kv.stats.queries, "prefix_cache_hits": self.kv.stats.hits,
                "num_preemptions": self.num_preemptions, **self.tier_stats,
                "host_tier_blocks": len(self.kv.host) if self.kv.host is not None else 0}
