"""ModelRunner: per-request worker state + the KV cache, turning a StepPlan into a StepResult.

The plan is a diff (step.proto): NewRequest carries every known token and the block table
once; CachedRequest only new block ids and counts; finished_ids drop state. For each
scheduled request we run tokens [num_computed, num_computed + num_scheduled) of its token
list; when that reaches the end of the known tokens we sample one token and append it, so
the next decode step (num_scheduled = 1) runs it without the scheduler sending it back.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from services.common import pb
from services.worker.attention import SeqSchedule, build_attn_metadata
from services.worker.models.llama import LlamaModel
from services.worker.sampling import (SampleRow, SamplingConfig, SamplingParamsError,
                                      new_base_seed, sample)

log = logging.getLogger(__name__)

MAX_BLOCK_SIZE = 1024
MIN_REQUEST_CAP = 1024


class PlanError(ValueError):
    """A StepPlan that contradicts the worker's state or limits (INVALID_ARGUMENT)."""


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]          # prompt + every output sampled so far
    block_ids: list[int]          # block table
    sampling: SamplingConfig
    base_seed: int
    num_output_tokens: int
    num_computed_tokens: int      # tokens whose K/V this worker has written (or were cached)


@dataclass
class _Scheduled:
    state: RequestState
    start: int                    # num_computed_tokens of this step
    count: int                    # num_scheduled_tokens of this step

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def samples(self) -> bool:
        return self.end == len(self.state.token_ids)


class ModelRunner:
    def __init__(self, model: LlamaModel, *, model_name: str, kv_cache_bytes: int,
                 num_kv_blocks: int | None = None, block_size: int = 16,
                 enforce_eager: bool = False, max_num_tokens: int = 16384,
                 seed_rng: random.Random | None = None) -> None:
        self.model = model
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
        self.allocate_kv_cache(block_size)

    # ---- KV cache ------------------------------------------------------------------------
    def allocate_kv_cache(self, block_size: int) -> None:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise PlanError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        num_blocks = self.fixed_num_blocks or self.kv_cache_bytes // self.model.kv_bytes_per_block(block_size)
        if num_blocks < 1:
            raise PlanError("the KV cache budget holds no block; raise --kv-cache-memory-gb")
        self.kv_caches = []  # free the old cache before allocating the new one
        self.gpu = None      # its graphs point into the old cache
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        # Zeros, not empty: padded decode gathers read unused slots, and NaN garbage there
        # would leak through the masked softmax.
        self.kv_caches = [torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
                          for _ in range(self.model.cfg.num_layers)]
        self.block_size, self.num_blocks = block_size, num_blocks
        if self.model.device.type == "cuda":
            # imports triton: GPU only
            from services.worker.gpu_exec import DEFAULT_GRAPH_SIZES, GpuExecutor
            self.gpu = GpuExecutor(self.model, self.kv_caches, block_size,
                                   max_num_tokens=self.max_num_tokens,
                                   graph_sizes=None if self.enforce_eager else DEFAULT_GRAPH_SIZES)
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, block_size,
                 num_blocks * self.model.kv_bytes_per_block(block_size) / 2**30)

    @property
    def max_requests(self) -> int:
        return max(MIN_REQUEST_CAP, self.num_blocks)

    def hello(self, block_size: int) -> pb.step.WorkerInfo:
        """A (re)connecting scheduler starts from an empty block pool: drop every request."""
        if block_size != self.block_size:
            self.allocate_kv_cache(block_size)
        self.requests.clear()
        cfg = self.model.cfg
        return pb.step.WorkerInfo(
            num_kv_blocks=self.num_blocks, block_size=self.block_size,
            max_model_len=self.model.max_model_len, vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids), model_name=self.model_name,
            device=describe_device(self.model.device))

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

    def _validate(self, plan: pb.step.StepPlan) -> dict[str, SamplingConfig]:
        """Check the whole plan before touching any state, so a bad plan changes nothing."""
        finished = set(plan.finished_ids)
        seen: set[str] = set()
        sampling: dict[str, SamplingConfig] = {}
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
            try:
                sampling[rid] = SamplingConfig.from_proto(r.sampling, vocab)
            except SamplingParamsError as exc:
                raise PlanError(f"request {rid}: {exc}") from None
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
            self._check_span(rid, r.num_computed_tokens, r.num_scheduled_tokens, len(state.token_ids),
                             len(state.block_ids) + len(r.new_block_ids))
            total += r.num_scheduled_tokens
        if live > self.max_requests:
            raise PlanError(f"{live} live requests exceed the worker's limit of {self.max_requests}")
        if self.gpu is not None and (total > self.gpu.max_tokens or len(seen) > self.gpu.max_seqs):
            raise PlanError(f"{total} tokens / {len(seen)} sequences in one step exceed the worker's "
                            f"{self.gpu.max_tokens} / {self.gpu.max_seqs}")
        if total > self.num_blocks * self.block_size:
            raise PlanError(f"{total} tokens in one step exceed the KV cache ({self.num_blocks} blocks)")
        return sampling

    def _apply(self, plan: pb.step.StepPlan, sampling: dict[str, SamplingConfig]) -> list[_Scheduled]:
        for rid in plan.finished_ids:
            # Unknown ids are fine: a request may finish before the worker ever saw it.
            self.requests.pop(rid, None)
        scheduled = []
        for r in plan.new_requests:
            cfg = sampling[r.request_id]
            state = RequestState(r.request_id, list(r.token_ids), list(r.block_ids), cfg,
                                 new_base_seed(cfg, self.seed_rng), r.num_output_tokens, r.num_computed_tokens)
            self.requests[r.request_id] = state
            scheduled.append(_Scheduled(state, r.num_computed_tokens, r.num_scheduled_tokens))
        for r in plan.cached_requests:
            state = self.requests[r.request_id]
            state.block_ids.extend(r.new_block_ids)
            scheduled.append(_Scheduled(state, r.num_computed_tokens, r.num_scheduled_tokens))
        return scheduled

    # ---- execution ------------------------------------------------------------------------
    def execute(self, plan: pb.step.StepPlan) -> pb.step.StepResult:
        """Run one step. Never raises: failures come back as StepResult.error."""
        result = pb.step.StepResult(step_id=plan.step_id)
        try:
            sampling = self._validate(plan)
        except PlanError as exc:
            log.warning("step %d rejected: %s", plan.step_id, exc)
            result.error.code = pb.common.ERROR_CODE_INVALID_ARGUMENT
            result.error.message = str(exc)
            return result
        t0 = time.perf_counter_ns()
        try:
            scheduled = self._apply(plan, sampling)
            sampled = self._run(scheduled) if scheduled else {}
        except Exception as exc:  # one bad step must not kill the worker
            log.exception("step %d failed", plan.step_id)
            result.error.code = pb.common.ERROR_CODE_INTERNAL
            result.error.message = f"worker step failed: {type(exc).__name__}: {exc}"
            return result
        result.forward_ns = time.perf_counter_ns() - t0
        for s in scheduled:
            out = result.outputs.add(request_id=s.state.request_id)
            tok = sampled.get(s.state.request_id)
            if tok is None:
                continue
            out.token_ids.append(tok.token_id)
            if tok.logprob is not None:
                lp = out.logprobs.add(token_id=tok.token_id, logprob=tok.logprob)
                for tid, val in tok.top or ():
                    lp.top.add(token_id=tid, logprob=val)
        return result

    @torch.inference_mode()
    def _run(self, scheduled: list[_Scheduled]) -> dict:
        # Single-token sequences first: attention batches them in one call (attention.py).
        order = sorted(scheduled, key=lambda s: s.count != 1)
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSchedule] = []
        sample_rows: list[int] = []
        sampling_seqs: list[_Scheduled] = []
        for s in order:
            ids.extend(s.state.token_ids[s.start:s.end])
            positions.extend(range(s.start, s.end))
            seqs.append(SeqSchedule(s.state.block_ids, s.start, s.count))
            if s.samples:
                sample_rows.append(len(ids) - 1)
                sampling_seqs.append(s)
        if self.gpu is not None:
            logits = self.gpu.run(ids, positions, seqs, sample_rows)                       # [N, V]
        else:
            logits = self._forward_reference(ids, positions, seqs, sample_rows)
        for s in order:
            s.state.num_computed_tokens = s.end
        if not sample_rows:
            return {}
        rows = [SampleRow(s.state.sampling, s.state.token_ids, s.state.num_output_tokens,
                          s.state.base_seed) for s in sampling_seqs]
        tokens = sample(logits, rows, self.model.cfg.eos_token_ids)
        out = {}
        for s, tok in zip(sampling_seqs, tokens):
            s.state.token_ids.append(tok.token_id)
            s.state.num_output_tokens += 1
            out[s.state.request_id] = tok
        return out

    def _forward_reference(self, ids: list[int], positions: list[int], seqs: list[SeqSchedule],
                           sample_rows: list[int]) -> torch.Tensor | None:
        """The torch reference forward (CPU path) -> float32 logits [N, V] of the sampling rows."""
        device = self.model.device
        meta = build_attn_metadata(seqs, self.block_size, device, self.model.cfg.sliding_window)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=device),
                                    torch.tensor(positions, dtype=torch.long, device=device),
                                    meta, self.kv_caches)                          # [T, H]
        if not sample_rows:
            return None
        last = hidden.index_select(0, torch.tensor(sample_rows, device=device))            # [N, H]
        return self.model.compute_logits(last)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
