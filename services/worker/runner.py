"""ModelRunner: per-request worker state + the KV cache, turning a StepPlan into a StepResult.

Plans and results are plan.py's values (wire.py converts the protobuf messages). The plan is a
diff (step.proto): NewRequest carries every known token and the block table
once; CachedRequest only new block ids and counts; finished_ids drop state. For each
scheduled request we run tokens [num_computed, num_computed + num_scheduled) of its token
list; when that reaches the end of the known tokens we sample one token and append it, so
the next decode step (num_scheduled = 1) runs it without the scheduler sending it back.

Host/GPU overlap: `submit(plan)` launches a step and returns at once; `collect(step)` waits for
its sampled tokens and builds the StepResult. The engine submits step N+1 (which the
scheduler's async scheduling already sent) before collecting step N, so the host prepares and
launches N+1 while the GPU still runs N. A token sampled by a step not yet collected is
"pending": the next step's input for it comes from the device buffer the sampler wrote
(GpuExecutor.prev_tokens), never from the host. On the CPU (`overlap` False) every submit
finishes its step: the same code, with nothing to overlap.

Rows whose sampling reads the host value of a pending token (repetition / frequency / presence
penalties read the token history; a structured-output mask (structured.py) depends on every token
sampled) need step N's tokens before step N+1 samples, but not before it runs its forward, whose
inputs come from the device. So submit launches N+1's forward first, then reads N's tokens (the
GPU is busy with N+1's forward meanwhile), computes the masks on the host, and only then enqueues
N+1's sampling: no bubble as long as the masks take less time than the forward.

Prompt logprobs (vLLM's prompt_logprobs, prompt_logprobs.py): a prefill step's rows that score
prompt tokens are reduced to logprob / rank / top-k right behind the forward (logits in slices of
rows), copied to the host asynchronously and read with the step's tokens in _resolve.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from services.worker.attention import SeqSchedule, build_attn_metadata
from services.worker.models.llama import LlamaModel
from services.worker.plan import (INTERNAL, INVALID_ARGUMENT, LoadResult, PlanError, SampledOutput, SamplingConfig,
                                  SaveResult, StepPlan, StepResult, TokenLogprob, WorkerInfo)
from services.worker import prompt_logprobs
from services.worker.sampling import SampleHandle, SampleRow, new_base_seed, sample_async
from services.worker.spec import device_steps, steps as spec_steps
from services.worker.spec.decoder import accepted_prefix
from services.worker.structured import Constraints, RequestMatcher

log = logging.getLogger(__name__)

MAX_BLOCK_SIZE = 1024
MIN_REQUEST_CAP = 1024


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]          # prompt + every output sampled so far
    block_ids: list[int]          # block table
    sampling: SamplingConfig
    base_seed: int
    num_output_tokens: int
    num_computed_tokens: int      # tokens whose K/V this worker has written (or were cached)
    num_pending: int = 0          # sampled by a step not collected yet (0 or 1): not in token_ids
    pending_row: int = -1         # ... at this row of that step's samples (prev_tokens)
    matcher: RequestMatcher | None = None   # structured output: fed every token in token_ids
    # Prompt logprobs: rows at positions < this score the prompt token after them (0: none wanted,
    # or already delivered before a preemption); prompt_len - 1 otherwise (prompt_logprobs.py).
    prompt_lp_end: int = 0
    spec_pending: bool = False    # its pending token is the end of a verified draft run (host only)
    dev_live: bool = False        # its device n-gram row holds every token, pending ones too (spec/device_steps.py)
    dev_slack: int = 0            # drafts of the device-fed step in flight: how far past num_computed it may be

    @property
    def num_known(self) -> int:
        return len(self.token_ids) + self.num_pending


@dataclass
class _Scheduled:
    state: RequestState
    start: int                    # num_computed_tokens of this step
    count: int                    # num_scheduled_tokens of this step (known tokens)
    budget: int = 0               # speculative decoding: drafts the scheduler made room for
    drafts: list[int] = field(default_factory=list)   # verified after the known tokens

    @property
    def n(self) -> int:
        """Tokens this step runs: the scheduled ones, then the drafts."""
        return self.count + len(self.drafts)

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def samples(self) -> bool:
        return self.start + self.count == self.state.num_known


@dataclass
class PendingStep:
    """A submitted step: launched, its tokens maybe still on the device."""

    step_id: int
    scheduled: list[_Scheduled]
    sampling_seqs: list[_Scheduled]
    handle: SampleHandle | None
    t0: int
    result: StepResult | None = None           # set at once for a rejected or failed step
    sampled: dict | None = None                # request id -> SampledToken, once resolved
    forward_ns: int = 0
    prompt_handle: prompt_logprobs.PromptLogprobHandle | None = None
    prompt_lps: dict | None = None             # request id -> [PromptLogprob], once resolved
    fed: object | None = None                  # spec.device_steps.FedStep: a device-fed step


class ModelRunner:
    def __init__(self, model: LlamaModel, *, model_name: str, kv_cache_bytes: int,
                 num_kv_blocks: int | None = None, block_size: int = 16,
                 enforce_eager: bool = False, max_num_tokens: int = 16384,
                 seed_rng: random.Random | None = None, kv_cache_dtype: torch.dtype | None = None,
                 tokenizer_path: str | None = None, export_kv: bool = False, export_nixl: bool = False) -> None:
        self.model = model
        # Direct hand-offs (kv_export.py): the cache in memory a peer worker can map (and, with
        # export_nixl, registered with a NIXL agent for peers on other hosts).
        self.export_kv = export_kv
        self.export_nixl = export_nixl
        self.exported = None
        self.kv_export_addr = ""
        # Structured outputs need the model's tokenizer.json (None: constrained requests end at once).
        self.constraints = Constraints(tokenizer_path, tuple(model.cfg.eos_token_ids), model.cfg.vocab_size,
                                       model_name)
        # Storage dtype of the KV cache: the model's dtype, or torch.float8_e4m3fn (--kv-cache-dtype fp8).
        self.kv_dtype = kv_cache_dtype or model.dtype
        # Base seeds of unseeded requests; tensor-parallel ranks pass one identically seeded rng
        # so every rank samples the same tokens (None: the process-wide `random`).
        self.seed_rng = seed_rng
        self.model_name = model_name
        self.kv_cache_bytes = kv_cache_bytes
        self.fixed_num_blocks = num_kv_blocks
        self.requests: dict[str, RequestState] = {}
        self.block_size = 0
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self.gpu = None  # GpuExecutor on CUDA devices (Triton kernels, CUDA graphs)
        self.enforce_eager = enforce_eager        # CUDA only: no graphs
        self.max_num_tokens = max_num_tokens      # CUDA only: size of the input buffers
        # Overlap the host side of step N+1 with the GPU running step N (module docstring).
        self.overlap = model.device.type == "cuda"
        self._unresolved: list[PendingStep] = []  # submitted, tokens not read yet (oldest first)
        self._cpu_prev = torch.zeros(0, dtype=torch.long)  # the CPU path's prev_tokens
        self._last_done_ns = 0
        self._last_submit = 0.0                   # speculative decoding: when the last step was submitted ...
        self._period_key: tuple[int, int] | None = None   # ... and its (rows, width) (device_steps.py)
        self.graph_capture_s = 0.0                # how long the last start-up capture took
        self.spec = None                          # spec.decoder.SpecDecoder with --speculative-config
        # Tensor parallel: the ranks agree on speculation's choices, rank 0's (tp_ranks.TpLink).
        self.tp_spec = None
        self.prompt_logprob_slice = prompt_logprobs.SLICE_ROWS   # rows of prompt logits alive at once
        self.tier_config = None                   # kv_tiers.TierConfig: host offload / kvstore (enable_kv_tiers)
        self.tiers = None                         # kv_tiers.KvTiers over the current cache
        self.allocate_kv_cache(block_size)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def num_unresolved(self) -> int:
        """Steps submitted whose tokens the host has not read yet (2 while steps overlap)."""
        return len(self._unresolved)

    # ---- KV cache ------------------------------------------------------------------------
    def allocate_kv_cache(self, block_size: int) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise PlanError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        num_blocks = self.fixed_num_blocks or self.kv_cache_bytes // self.model.kv_bytes_per_block(block_size, self.kv_dtype)
        if num_blocks < 1:
            raise PlanError("the KV cache budget holds no block; raise --kv-cache-memory-gb")
        if self.tiers is not None:   # its fetches write into the old cache: let them end first
            self.tiers.close()
            self.tiers = None
        self.kv_caches = []  # free the old cache before allocating the new one
        self.exported = None
        self.gpu = None      # its graphs point into the old cache
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        # Zeros, not empty: padded decode gathers read unused slots, and NaN garbage there
        # would leak through the masked softmax.
        if self.export_kv:
            from services.worker.kv_export import ExportedCache
            self.exported = ExportedCache(self.model.cfg.num_layers, shape, self.kv_dtype, self.model.device,
                                          nixl=self.export_nixl)
            self.kv_caches = self.exported.layers
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.model.device)
                              for _ in range(self.model.cfg.num_layers)]
        self.block_size, self.num_blocks = block_size, num_blocks
        if self.model.device.type == "cuda":
            # imports triton: GPU only
            from services.worker.gpu_exec import DEFAULT_GRAPH_SIZES, GpuExecutor
            self.gpu = GpuExecutor(self.model, self.kv_caches, block_size,
                                   max_num_tokens=self.max_num_tokens,
                                   graph_sizes=None if self.enforce_eager else DEFAULT_GRAPH_SIZES)
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, block_size,
                 num_blocks * self.model.kv_bytes_per_block(block_size, self.kv_dtype) / 2**30)
        if self.gpu is not None and self.gpu.graph_sizes:
            # Every decode graph now, against this cache, not in the middle of serving (where the
            # first step of each batch size would stall for its capture).
            self.graph_capture_s = self.gpu.capture_at_startup()
            if self.spec is not None:
                self.graph_capture_s += self.gpu.capture_verify(self.spec.cfg.num_speculative_tokens)
        if self.gpu is not None:
            # The eager steps' kernel variants too (prompts, mixed steps): compiled now, not mid-serving.
            try:
                self.graph_capture_s += self.gpu.warm_eager()
            except Exception:  # noqa: BLE001 - serving compiles them when first needed instead
                log.exception("warming the eager step kernels failed")
        if self.tier_config is not None:
            self._build_tiers()

    def enable_spec(self, decoder) -> None:
        """Speculative decoding (spec.decoder.SpecDecoder); on a GPU its verify steps get CUDA
        graphs (gpu_verify.py), captured now against the current cache."""
        self.spec = decoder
        cfg = decoder.cfg
        if not decoder.follower and device_steps.enabled() and (
                cfg.method == "ngram" or device_steps.chains_enabled()):
            decoder.device = device_steps.device_proposer(cfg, self.model.max_model_len, self.model.device)
            if self.gpu is not None:   # imports triton: GPU only
                from services.worker.gpu_fed import warm_up
                try:
                    warm_up(self.gpu, decoder.device, device_steps.widths(self, 1))
                except Exception:  # noqa: BLE001 - speculation still works, on the host path
                    log.exception("device-fed speculative steps are off: their kernels failed to build")
                    decoder.device = None
        if self.gpu is not None and self.gpu.graph_sizes:
            self.graph_capture_s += self.gpu.capture_verify(decoder.cfg.num_speculative_tokens)

    def enable_kv_tiers(self, config) -> None:
        """Tier-1 host offload and/or kvstore fetches and saves (kv_tiers.TierConfig)."""
        self.tier_config = config
        self._build_tiers()

    def _build_tiers(self) -> None:
        from services.worker.kv_tiers import KvTiers
        self.tiers = KvTiers(self.kv_caches, self.block_size, self.tier_config, self.exported)

    @property
    def max_requests(self) -> int:
        return max(MIN_REQUEST_CAP, self.num_blocks)

    def hello(self, block_size: int) -> WorkerInfo:
        """A (re)connecting scheduler starts from an empty block pool: drop every request."""
        self._resolve_all()
        if self.tiers is not None:
            self.tiers.drain()   # fetches of the old scheduler's requests: ended, results dropped
        if block_size != self.block_size:
            self.allocate_kv_cache(block_size)
        self.requests.clear()
        if self.spec is not None:   # its proposers (and a draft model's KV pool) follow the requests
            self.spec.reset(self.num_blocks, self.block_size)
        cfg = self.model.cfg
        tiers = self.tiers
        return WorkerInfo(self.num_blocks, self.block_size, self.model.max_model_len, cfg.vocab_size,
                          tuple(cfg.eos_token_ids), self.model_name, describe_device(self.model.device),
                          tiers.num_slots if tiers is not None else 0,
                          tiers.namespace if tiers is not None else None,
                          self.kv_export_addr if self.exported is not None else "")

    # ---- plan validation and application --------------------------------------------------
    def _check_blocks(self, rid: str, block_ids) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise PlanError(f"request {rid}: block id {b} outside [0, {self.num_blocks})")

    def _check_span(self, rid: str, start: int, count: int, num_tokens: int, num_blocks: int) -> None:
        if start < 0 or count < 1:
            raise PlanError(f"request {rid}: num_computed_tokens {start} / num_scheduled_tokens "
                            f"{count} must be >= 0 / >= 1")
        end = start + count
        if end > num_tokens:
            raise PlanError(f"request {rid}: scheduled up to token {end} but only {num_tokens} known")
        if end > self.model.max_model_len:
            raise PlanError(f"request {rid}: {end} tokens exceed max_model_len {self.model.max_model_len}")
        if end > num_blocks * self.block_size:
            raise PlanError(f"request {rid}: {end} tokens need {-(-end // self.block_size)} blocks, "
                            f"table has {num_blocks}")

    def _validate(self, plan: StepPlan) -> None:
        """Check the whole plan before touching any state, so a bad plan changes nothing.
        (Sampling parameters were checked by the wire: a plan it refused arrives `invalid`.)"""
        if plan.invalid:
            raise PlanError(plan.invalid)
        if plan.has_tier_work:
            if self.tiers is None:
                raise PlanError("the plan moves KV blocks between tiers but this worker has none")
            self.tiers.check(plan)
        finished = set(plan.finished_ids)
        seen: set[str] = set()
        vocab = self.model.cfg.vocab_size
        total = 0
        live = sum(1 for rid in self.requests if rid not in finished)
        for r in plan.new_requests:
            rid = r.request_id
            if not rid or rid in seen:
                raise PlanError(f"empty or duplicate request id {rid!r} in the plan")
            seen.add(rid)
            if rid in self.requests and rid not in finished:
                raise PlanError(f"new request {rid} is already running on this worker")
            if any(not 0 <= t < vocab for t in r.token_ids):
                raise PlanError(f"request {rid}: token id outside the vocabulary [0, {vocab})")
            if not 0 <= r.num_output_tokens <= len(r.token_ids):
                raise PlanError(f"request {rid}: num_output_tokens {r.num_output_tokens} out of range")
            self._check_blocks(rid, r.block_ids)
            self._check_span(rid, r.num_computed_tokens, r.num_scheduled_tokens, len(r.token_ids),
                             len(r.block_ids))
            total += r.num_scheduled_tokens
            live += 1
        for r in plan.cached_requests:
            rid = r.request_id
            if rid in seen:
                raise PlanError(f"duplicate request id {rid!r} in the plan")
            seen.add(rid)
            state = self.requests.get(rid)
            if state is None or rid in finished:
                raise PlanError(f"unknown request id {rid!r}")
            self._check_blocks(rid, r.new_block_ids)
            if r.num_spec_tokens < 0:
                raise PlanError(f"request {rid}: num_spec_tokens {r.num_spec_tokens} must be >= 0")
            # Accepted drafts put the worker ahead of the plan's count (a lower bound, step.proto).
            self._check_span(rid, max(r.num_computed_tokens, state.num_computed_tokens), r.num_scheduled_tokens,
                             state.num_known, len(state.block_ids) + len(r.new_block_ids))
            total += r.num_scheduled_tokens + r.num_spec_tokens
        if live > self.max_requests:
            raise PlanError(f"{live} live requests exceed the worker's limit of {self.max_requests}")
        if self.gpu is not None and (total > self.gpu.max_tokens or len(seen) > self.gpu.max_seqs):
            raise PlanError(f"{total} tokens / {len(seen)} sequences in one step exceed the worker's "
                            f"{self.gpu.max_tokens} / {self.gpu.max_seqs}")
        if total > self.num_blocks * self.block_size:
            raise PlanError(f"{total} tokens in one step exceed the KV cache ({self.num_blocks} blocks)")

    def _apply(self, plan: StepPlan, fed=None) -> list[_Scheduled]:
        for rid in plan.finished_ids:
            # Unknown ids are fine: a request may finish before the worker ever saw it.
            self.requests.pop(rid, None)
            if self.spec is not None:
                self.spec.finish(rid)
        scheduled = []
        for r in plan.new_requests:
            cfg = r.sampling
            state = RequestState(r.request_id, list(r.token_ids), list(r.block_ids), cfg,
                                 new_base_seed(cfg, self.seed_rng), r.num_output_tokens, r.num_computed_tokens)
            if cfg.prompt_logprobs is not None and r.num_output_tokens == 0:
                state.prompt_lp_end = len(r.token_ids) - 1
            if cfg.structured is not None:
                state.matcher = self.constraints.start(r.request_id, cfg.structured,
                                                       r.token_ids[len(r.token_ids) - r.num_output_tokens:])
            if self.spec is not None:
                self.spec.start(r.request_id, state.token_ids, r.num_output_tokens)
            self.requests[r.request_id] = state
            scheduled.append(_Scheduled(state, r.num_computed_tokens, r.num_scheduled_tokens))
        for r in plan.cached_requests:
            state = self.requests[r.request_id]
            state.block_ids.extend(r.new_block_ids)
            start = max(r.num_computed_tokens, state.num_computed_tokens)
            scheduled.append(_Scheduled(state, start, r.num_scheduled_tokens,
                                        r.num_spec_tokens if self.spec is not None else 0))
        if fed is not None:   # drafts come from the device (spec/device_steps.py)
            self.spec.acceptance.tick()
        elif self.spec is not None:
            spec_steps.plan_drafts(self, scheduled)
        return scheduled

    # ---- execution ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step to the end. Never raises: failures come back as StepResult.error."""
        return self.collect(self.submit(plan))

    def submit(self, plan: StepPlan) -> PendingStep:
        """Validate, apply and launch one step; returns before its tokens are read (GPU)."""
        t0 = time.perf_counter_ns()
        synced = False
        if self.spec is not None:
            self._time_period(t0 / 1e9)
        fed = device_steps.fed_plan(self, plan) if self.spec is not None else None
        if fed is None and self.spec is not None and spec_steps.read_first(self, plan):
            synced = True
            # A verified run's length is known once read: before this plan is checked against it.
            try:
                self._resolve_all()
            except Exception as exc:  # noqa: BLE001 - as a failed step (collect reports it too)
                log.exception("step %d failed", plan.step_id)
                result = StepResult.failed(plan.step_id, INTERNAL, f"worker step failed: {type(exc).__name__}: {exc}")
                return PendingStep(plan.step_id, [], [], None, t0, result=self._refused_tiers(plan, result))
            # Everything read: the step can be device-fed again (after a host verify step's end).
            fed = device_steps.fed_plan(self, plan)
        try:
            self._validate(plan)
        except PlanError as exc:
            log.warning("step %d rejected: %s", plan.step_id, exc)
            result = StepResult.failed(plan.step_id, INVALID_ARGUMENT, str(exc))
            return PendingStep(plan.step_id, [], [], None, t0, result=self._refused_tiers(plan, result))
        started = saved = False
        try:
            # Inputs may point at the latest submitted step's samples only: older ones (and that
            # one too without overlap) are read first. Rows that sample from host token values
            # read it after the forward is launched (_launch).
            for p in list(self._unresolved[:-1] if self.overlap else self._unresolved):
                self._resolve(p)
            t_host = time.perf_counter()
            scheduled = self._apply(plan, fed)
            if plan.has_tier_work:   # stream-ordered before the forward (kv_tiers.py)
                self.tiers.apply_host_copies(plan)
                self.tiers.start_loads(plan.tier_loads)
                started = True
            if not scheduled:   # only finished_ids: nothing to run
                if plan.tier_saves:
                    self.tiers.refuse_saves(plan.tier_saves)
                return PendingStep(plan.step_id, [], [], None, t0, sampled={})
            if fed is not None:
                handle, fed_step = device_steps.launch(self, scheduled, fed)
                step = PendingStep(plan.step_id, scheduled, list(scheduled), handle, t0, fed=fed_step)
                self._unresolved.append(step)
                self._period_key = (len(scheduled), fed.width)
            else:
                step = self._launch(plan.step_id, scheduled, t0)
                # Steps of decode rows only, plain (width 1) or with host drafts (width 0).
                decode = self.spec is not None and not plan.new_requests and all(s.count == 1 for s in scheduled)
                self._period_key = (len(scheduled), 0 if any(s.drafts for s in scheduled) else 1) if decode else None
            if self.spec is not None and self.overlap and fed is None:
                if not any(s.drafts for s in scheduled):
                    self.spec.host_time(time.perf_counter() - t_host)   # what a sync would expose
                elif synced:   # what this one exposed, from the previous step's tokens read
                    self.spec.spec_host_time(len(scheduled), (time.perf_counter_ns() - self._last_done_ns) / 1e9)
            if plan.tier_saves:   # right behind the forward that computed them
                saved = True
                self.tiers.save(plan.tier_saves)
            return step
        except Exception as exc:  # one bad step must not kill the worker
            log.exception("step %d failed", plan.step_id)
            result = StepResult.failed(plan.step_id, INTERNAL, f"worker step failed: {type(exc).__name__}: {exc}")
            return PendingStep(plan.step_id, [], [], None, t0,
                               result=self._refused_tiers(plan, result, loads=not started, saves=not saved))

    def _time_period(self, now: float) -> None:
        """The last step's submit-to-submit period, for the device-fed width choice (only while
        steps overlap: otherwise each submit waits for its own step)."""
        key, self._period_key = self._period_key, None
        if key is not None and self.overlap and self._last_submit:
            self.spec.step_period(key[0], key[1], now - self._last_submit)
        self._last_submit = now

    def _refused_tiers(self, plan: StepPlan, result: StepResult, loads: bool = True, saves: bool = True) -> StepResult:
        """A plan refused or failed before its kvstore fetches (saves) started: they are reported
        at once as nothing loaded (saved), so their requests are recomputed, never left waiting."""
        if loads:
            result.kv_loads = [LoadResult(t.request_id, 0, len(t.block_ids)) for t in plan.tier_loads]
        if saves:
            result.kv_saves = [SaveResult(t.request_id, len(t.block_ids), 0) for t in plan.tier_saves]
        return result

    def collect(self, step: PendingStep) -> StepResult:
        """Wait for a submitted step's tokens (and every earlier step's) -> its StepResult, with
        the kvstore fetches that ended meanwhile (a plan with nothing to run, sent only to hear
        about them, waits a few ms for one)."""
        result = self._collect(step)
        tiers = self.tiers
        if tiers is not None and (tiers.busy or tiers.has_done):
            if not step.scheduled and not tiers.has_done:
                tiers.wait_done(0.005)
            result.kv_loads = [*result.kv_loads, *tiers.take_loads()]
            result.kv_saves = [*result.kv_saves, *tiers.take_saves()]
        return result

    def _collect(self, step: PendingStep) -> StepResult:
        if step.result is not None:
            return step.result
        if step.sampled is not None and step not in self._unresolved:
            step.forward_ns = step.forward_ns or time.perf_counter_ns() - step.t0
        try:
            while self._unresolved and step in self._unresolved:
                self._resolve(self._unresolved[0])
        except Exception as exc:  # noqa: BLE001 - e.g. a device error surfacing at the sync
            log.exception("step %d failed", step.step_id)
            return StepResult.failed(step.step_id, INTERNAL, f"worker step failed: {type(exc).__name__}: {exc}")
        sampled = step.sampled or {}
        prompt_lps = step.prompt_lps or {}
        outputs = []
        for s in step.scheduled:
            rid = s.state.request_id
            toks = sampled.get(rid)
            if toks is None:  # a prompt chunk short of the prompt's end
                outputs.append(SampledOutput(rid, [], [], prompt_lps.get(rid)))
                continue
            lps = [TokenLogprob(t.token_id, t.logprob, t.top or []) for t in toks if t.logprob is not None]
            outputs.append(SampledOutput(rid, [t.token_id for t in toks], lps, prompt_lps.get(rid), len(s.drafts)))
        return StepResult(step.step_id, outputs, step.forward_ns)

    def ready(self, step: PendingStep) -> bool:
        """Would collect(step) return without waiting for the device?"""
        return step.handle is None or step not in self._unresolved or step.handle.ready()

    @staticmethod
    def _needs_host_tokens(sampling_seqs: list[_Scheduled]) -> bool:
        """Penalties and grammar masks read the token history: a pending token must reach the host
        before the row samples."""
        return any(s.state.num_pending and (s.state.sampling.has_penalties or s.state.matcher is not None)
                   for s in sampling_seqs)

    def _resolve(self, step: PendingStep) -> None:
        """Read a step's sampled tokens into the requests' host state (waits for the device)."""
        self._unresolved.remove(step)
        step.sampled = {}
        try:
            tokens = step.handle.result() if step.handle is not None else []
            if step.prompt_handle is not None:
                step.prompt_lps, step.prompt_handle = step.prompt_handle.result(), None
        except Exception:
            for s in step.sampling_seqs:   # never feed later steps from a failed one
                s.state.num_pending = 0
                s.state.dev_live = False
            raise
        finally:
            now = time.perf_counter_ns()
            # Device time of this step without counting the overlap with the one before twice.
            step.forward_ns = now - max(step.t0, self._last_done_ns)
            self._last_done_ns = now
        if step.fed is not None:
            device_steps.resolve(self, step, tokens)
            self.spec.flush_metrics()
            return
        i = accepted = 0
        drafted = False
        for s in step.sampling_seqs:
            st = s.state
            toks = tokens[i:i + 1 + len(s.drafts)]
            i += len(toks)
            if s.drafts:   # the accepted drafts and the token after them; the KV of the rest is stale
                a = accepted_prefix(s.drafts, [t.token_id for t in toks])
                toks = toks[:a + 1]
                st.num_computed_tokens = s.start + s.count + a
                self.spec.observe(st.request_id, len(s.drafts), a)
                accepted += a
                drafted = True
            st.num_pending -= 1
            if not st.num_pending:   # else a later step in flight set it (a device-fed one may follow this)
                st.spec_pending = False
            for tok in toks:
                st.token_ids.append(tok.token_id)
                st.num_output_tokens += 1
                if st.matcher is not None:
                    st.matcher.consume(tok.token_id)
            if self.spec is not None:
                self.spec.extend(st.request_id, [t.token_id for t in toks])
            step.sampled[st.request_id] = toks
        if self.spec is not None:
            if drafted:   # its tokens against its measured period (SpecDecoder.host_spec_pays)
                self.spec.host_spec_step(len(step.scheduled), accepted)
            self.spec.flush_metrics()

    def _resolve_all(self) -> None:
        while self._unresolved:
            self._resolve(self._unresolved[0])

    @torch.inference_mode()
    def _launch(self, step_id: int, scheduled: list[_Scheduled], t0: int) -> PendingStep:
        # Single-token sequences first: attention batches them in one call (attention.py).
        order = sorted(scheduled, key=lambda s: s.n != 1)
        ids: list[int] = []
        positions: list[int] = []
        src: list[int] = []           # -1: the host id; r >= 0: row r of the previous samples
        seqs: list[SeqSchedule] = []
        sample_rows: list[int] = []
        sampling_seqs: list[_Scheduled] = []
        spans: list[prompt_logprobs.PromptSpan] = []   # rows that score prompt tokens
        any_src = False
        for s in order:
            st = s.state
            host = len(st.token_ids)
            if st.prompt_lp_end > s.start:
                span = prompt_logprobs.span_of(st.request_id, st.token_ids, s.start, s.end, len(ids),
                                               st.prompt_lp_end, st.sampling.prompt_logprobs)
                if span is not None:
                    spans.append(span)
            if s.drafts:   # known tokens (all on the host, see spec/steps.read_first), then the drafts
                ids.extend(st.token_ids[s.start:s.start + s.count])
                ids.extend(s.drafts)
                src.extend([-1] * s.n)
            elif s.end <= host:
                ids.extend(st.token_ids[s.start:s.end])
                src.extend([-1] * s.count)
            else:  # the last scheduled token is pending (validated: end <= num_known)
                ids.extend(st.token_ids[s.start:host])
                ids.append(0)
                src.extend([-1] * (host - s.start))
                src.append(st.pending_row)
                any_src = True
            positions.extend(range(s.start, s.end))
            seqs.append(SeqSchedule(st.block_ids, s.start, s.n))
            if s.samples:   # the last known token's row, then one row per draft
                sample_rows.extend(range(len(ids) - 1 - len(s.drafts), len(ids)))
                sampling_seqs.append(s)
        if self.gpu is not None:
            logits, hidden = self.gpu.run(ids, positions, seqs, sample_rows, src if any_src else None,
                                          keep_hidden=bool(spans))                   # [N, V], [T, H]
        else:
            logits, hidden = self._forward_reference(ids, positions, seqs, sample_rows, src if any_src else None)
        prompt_handle = None
        if spans:  # enqueued behind the forward, before sampling; read when the step resolves
            prompt_handle = prompt_logprobs.compute(hidden, spans, self._logits_fn, self.prompt_logprob_slice)
        del hidden
        if self._unresolved and self._needs_host_tokens(sampling_seqs):
            # While the device runs this forward: the previous step's tokens reach the host.
            self._resolve_all()
        for s in order:
            s.state.num_computed_tokens = s.end
        handle = None
        if sample_rows:
            rows, matchers = [], []
            # A step with drafts samples more rows than the prev-token buffer holds and a run's
            # last token sits at no fixed row: its tokens go to the host only, and the next step
            # reads them before it is built (spec/steps.read_first).
            verifies = any(s.drafts for s in sampling_seqs)
            for s in sampling_seqs:
                st = s.state
                done = st.num_output_tokens + st.num_pending
                st.pending_row = -1 if verifies else len(rows)
                st.spec_pending = verifies
                st.dev_live = False    # the device n-gram row misses this token (device_steps.py)
                # A draft row samples as plain decoding would at its position: the drafts before
                # it are its history (penalties) and its grammar prefix (masks).
                for j in range(len(s.drafts) + 1):
                    prefix = s.drafts[:j]
                    rows.append(SampleRow(st.sampling, st.token_ids + prefix if j else st.token_ids, done + j,
                                          st.base_seed, position=st.num_known + j, draft_prefix=prefix))
                    matchers.append(st.matcher)
                st.num_pending += 1
            bitmask = self.constraints.prepare(rows, matchers)
            handle = sample_async(logits, rows, self.model.cfg.eos_token_ids,
                                  out=None if verifies else self._prev_out(len(rows)), bitmask=bitmask)
            if verifies:
                self.spec.stepped()
        step = PendingStep(step_id, scheduled, sampling_seqs, handle, t0, prompt_handle=prompt_handle)
        self._unresolved.append(step)
        return step

    def _prev_out(self, n: int) -> torch.Tensor:
        """Where the sampler leaves this step's ids for the next step's inputs."""
        if self.gpu is not None:
            return self.gpu.prev_tokens[:n]
        if n > self._cpu_prev.numel():
            grown = torch.zeros(max(n, 2 * self._cpu_prev.numel()), dtype=torch.long)
            grown[:self._cpu_prev.numel()] = self._cpu_prev
            self._cpu_prev = grown
        return self._cpu_prev[:n]

    def _logits_fn(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, H] -> float32 logits [s, V], as the step's own sampling rows get them."""
        if self.gpu is not None:
            from services.worker.models.llama_triton import compute_logits_triton  # imports triton
            return compute_logits_triton(self.model, hidden)
        return self.model.compute_logits(hidden)

    def _forward_reference(self, ids: list[int], positions: list[int], seqs: list[SeqSchedule],
                           sample_rows: list[int], src: list[int] | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The torch reference forward (CPU path) -> (float32 logits [N, V] of the sampling rows,
        the final hidden states [T, H] of every row)."""
        device = self.model.device
        meta = build_attn_metadata(seqs, self.block_size, device, self.model.cfg.sliding_window)
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if src is not None:
            input_ids = resolve_ids(input_ids, torch.tensor(src, dtype=torch.long, device=device),
                                    self._cpu_prev.to(device))
        hidden = self.model.forward(input_ids, torch.tensor(positions, dtype=torch.long, device=device),
                                    meta, self.kv_caches)                          # [T, H]
        if not sample_rows:
            return None, hidden
        last = hidden.index_select(0, torch.tensor(sample_rows, device=device))            # [N, H]
        return self.model.compute_logits(last), hidden


def resolve_ids(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """ids with src >= 0 replaced by prev_tokens[src] (what kernels/embedding.py does on a GPU)."""
    return torch.where(src >= 0, prev_tokens[src.clamp(min=0)], ids)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
