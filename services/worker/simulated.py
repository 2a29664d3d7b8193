"""A no-compute runner: the worker's step contract (step.proto) without a model.

It keeps only token counts per request, "samples" a deterministic pseudo-random token when a
request's scheduled tokens reach the end of its known tokens (as ModelRunner does), and takes a
configurable time per step, so the CPU cost of the gateway, tokenizer and scheduler can be
measured alone (`meshllm serve MODEL --simulate-worker --simulate-step-ms 10`). The worker's own
engine loop (engine.py) drives it, exactly as it drives the real ModelRunner.

A decode step runs the token this runner sampled in the previous step, which the scheduler never
sends back: the same contract as the real worker, so async scheduling (plan N+1 sent before
result N arrives) works unchanged. No torch import: vocabulary, EOS ids, context length and KV
geometry come from the model dir's config.json.
"""
from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from services.worker.config import WorkerConfig
from services.worker.control import WorkerControlServicer
from services.worker.engine import LoadFailed, RunnerSource
from services.worker.plan import (INVALID_ARGUMENT, PlanError, SampledOutput, StepPlan, StepResult,
                                  WorkerInfo)

log = logging.getLogger("meshllm.worker.simulated")

_MIN_TOKEN_ID = 100          # skip the low ids, where BPE vocabularies keep special tokens
_MAX_REQUESTS = 65536        # bounds the per-request map against a runaway scheduler


@dataclass(frozen=True)
class SimSpec:
    """What the worker reports in WorkerInfo, read from config.json (+ generation_config.json)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    kv_bytes_per_token: int   # 2 (K and V) * layers * kv_heads * head_dim * 4 bytes (fp32)

    @classmethod
    def from_model_dir(cls, model_dir: str, max_model_len: int = 0) -> "SimSpec":
        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        gen = d / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        heads = int(cfg.get("num_attention_heads", 1))
        head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", heads)) // heads)
        layers = int(cfg.get("num_hidden_layers", 1))
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        return cls(vocab_size=int(cfg["vocab_size"]), eos_token_ids=eos_ids,
                   max_model_len=max_model_len or int(cfg.get("max_position_embeddings", 2048)),
                   kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4)


@dataclass(slots=True)
class SimulatedStep:
    """A submitted step: its result is known at once; collect waits out its simulated time."""

    result: StepResult
    num_tokens: int           # tokens scheduled (what the simulated time is charged for)
    t0: float                 # perf_counter at submit
    done_at: float            # perf_counter when the simulated compute ends


class SimulatedRunner:
    """Per-request token counts behind the engine's runner interface (engine.Runner)."""

    overlap = False  # nothing runs in the background: each step is finished when collected

    def __init__(self, spec: SimSpec, *, model_name: str, kv_cache_bytes: int, num_kv_blocks: int = 0,
                 block_size: int = 16, step_ms: float = 0.0, token_ms: float = 0.0) -> None:
        self.spec, self.model_name = spec, model_name
        self.kv_cache_bytes, self.fixed_num_blocks = kv_cache_bytes, num_kv_blocks
        self.step_s, self.token_s = step_ms / 1e3, token_ms / 1e3
        # request id -> [num_tokens, rng state]; tokens = prompt + outputs sampled so far
        self.requests: dict[str, list[int]] = {}
        self.block_size, self.num_blocks = 0, 0
        self._set_block_size(block_size)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def _set_block_size(self, block_size: int) -> None:
        if not 1 <= block_size <= 1024:
            raise PlanError(f"block_size must be in [1, 1024], got {block_size}")
        num = self.fixed_num_blocks or self.kv_cache_bytes // (self.spec.kv_bytes_per_token * block_size)
        if num < 1:
            raise PlanError("the KV cache budget holds no block; raise --kv-cache-memory-gb")
        self.block_size, self.num_blocks = block_size, num

    def hello(self, block_size: int) -> WorkerInfo:
        self._set_block_size(block_size)
        self.requests.clear()
        return WorkerInfo(self.num_blocks, self.block_size, self.spec.max_model_len, self.spec.vocab_size,
                          self.spec.eos_token_ids, self.model_name, "simulated")

    def _sample(self, state: list[int]) -> int:
        # 64-bit LCG per request: deterministic, cheap, never an EOS id.
        state[1] = (state[1] * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        lo = min(_MIN_TOKEN_ID, self.spec.vocab_size // 2)
        tok = lo + (state[1] >> 33) % (self.spec.vocab_size - lo)
        while tok in self.spec.eos_token_ids:
            tok = lo + (tok + 1 - lo) % (self.spec.vocab_size - lo)
        return tok

    def submit(self, plan: StepPlan) -> SimulatedStep:
        """Apply the plan and sample its tokens now; the step's simulated time starts here."""
        t0 = time.perf_counter()
        try:
            work = self._apply(plan)
        except PlanError as exc:
            log.warning("step %d rejected: %s", plan.step_id, exc)
            return SimulatedStep(StepResult.failed(plan.step_id, INVALID_ARGUMENT, str(exc)), 0, t0,
                                 t0 + self.step_s)
        total = 0
        outputs = []
        for rid, state, end, count in work:
            total += count
            if end == state[0]:            # reached the end of the known tokens: sample one
                outputs.append(SampledOutput(rid, [self._sample(state)], []))
                state[0] += 1
            else:
                outputs.append(SampledOutput(rid, [], []))
        return SimulatedStep(StepResult(plan.step_id, outputs), total, t0, t0 + self.step_s + self.token_s * total)

    def ready(self, step: SimulatedStep) -> bool:
        return time.perf_counter() >= step.done_at

    def collect(self, step: SimulatedStep) -> StepResult:
        """Wait out the step's simulated time (step_ms + token_ms * scheduled tokens)."""
        left = step.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        step.result.forward_ns = int((time.perf_counter() - step.t0) * 1e9)
        return step.result

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.submit(plan))

    def _apply(self, plan: StepPlan) -> list[tuple[str, list[int], int, int]]:
        """Validate and apply the diff; returns (id, state, scheduled end, count) per request.
        Bad plans change nothing (checked before any state is touched)."""
        if plan.invalid:
            raise PlanError(plan.invalid)
        finished = set(plan.finished_ids)
        work = []
        for r in plan.new_requests:
            if not r.request_id or (r.request_id in self.requests and r.request_id not in finished):
                raise PlanError(f"new request {r.request_id!r} is empty or already running")
            end = r.num_computed_tokens + r.num_scheduled_tokens
            if r.num_scheduled_tokens < 1 or end > len(r.token_ids):
                raise PlanError(f"request {r.request_id}: scheduled up to token {end} "
                                f"but only {len(r.token_ids)} known")
            work.append((r.request_id, [len(r.token_ids), zlib.crc32(r.request_id.encode())], end,
                         r.num_scheduled_tokens))
        for r in plan.cached_requests:
            state = None if r.request_id in finished else self.requests.get(r.request_id)
            if state is None:
                raise PlanError(f"unknown request id {r.request_id!r}")
            end = r.num_computed_tokens + r.num_scheduled_tokens
            if r.num_scheduled_tokens < 1 or end > state[0]:
                raise PlanError(f"request {r.request_id}: scheduled up to token {end} "
                                f"but only {state[0]} known")
            work.append((r.request_id, state, end, r.num_scheduled_tokens))
        if len(self.requests) + len(plan.new_requests) - len(finished) > _MAX_REQUESTS:
            raise PlanError(f"more than {_MAX_REQUESTS} live requests")
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)   # unknown ids are fine (finished before it ran)
        for rid, state, _, _ in work[:len(plan.new_requests)]:
            self.requests[rid] = state
        return work


def simulated_source(cfg: WorkerConfig) -> RunnerSource:
    """serve()'s source for --simulate. WorkerControl answers but refuses captures: nothing here
    runs torch (control.py)."""
    try:
        spec = SimSpec.from_model_dir(cfg.model, cfg.max_model_len)
    except (OSError, ValueError, KeyError) as exc:
        raise LoadFailed(f"cannot read {cfg.model}/config.json: {exc}") from None

    def load() -> SimulatedRunner:
        runner = SimulatedRunner(spec, model_name=cfg.served_model_name, kv_cache_bytes=cfg.kv_cache_bytes,
                                 num_kv_blocks=cfg.num_kv_blocks, block_size=cfg.block_size,
                                 step_ms=cfg.simulate_step_ms, token_ms=cfg.simulate_token_ms)
        log.info("SIMULATED worker (no model): %.2f ms/step + %.3f ms/token, %d KV blocks, vocab %d",
                 cfg.simulate_step_ms, cfg.simulate_token_ms, runner.num_blocks, spec.vocab_size)
        return runner

    control = WorkerControlServicer(refusal="the simulated worker runs no model: nothing to profile "
                                            "(start the mesh without --simulate-worker)")
    return RunnerSource(load=load, control=control)
