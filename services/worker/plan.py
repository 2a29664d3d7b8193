"""The worker's own values for what crosses its link: plans in, results and info out.

wire.py makes them from step.proto messages and turns them back; everything behind it (the
engine loop, the runners, step tracing) reads these and never a protobuf. No torch here: the
simulated worker runs on these types without it.

Slotted dataclasses: the hot path builds one CachedRequest and one SampledOutput per running
request per step (256 of each at batch 256), so construction and attribute reads must be cheap.
"""
from __future__ import annotations

from dataclasses import dataclass

# Error codes of a failed step (wire.py maps them to common.proto's ErrorCode).
INVALID_ARGUMENT = "invalid_argument"   # the plan: nothing of it was applied
INTERNAL = "internal"                   # the worker: the step failed while running

_GREEDY_EPS = 1e-5


class PlanError(ValueError):
    """A plan or hello that contradicts the worker's state or limits (INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """One request's validated sampling parameters (wire.sampling_from_proto checks them)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                  # <= 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None     # None: no logprobs; N: the sampled token's + top N
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's + top N (prompt_logprobs.py)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # (kind, llguidance grammar text) of a structured output (structured.py enforces it); None: free
    # text. Grammar "" : the wire could not convert the constraint, the request is ended cleanly.
    structured: tuple[str, str] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class TraceContext:
    """W3C trace context of a traced request (the scheduler's span): step_tracing.py parents
    the worker's spans on it."""

    traceparent: str
    tracestate: str = ""


@dataclass(slots=True)
class NewRequest:
    """A request's first plan (or its return after a preemption): every known token and the
    whole block table, once."""

    request_id: str
    token_ids: list[int]            # the prompt, plus earlier outputs when a preempted request resumes
    block_ids: list[int]
    sampling: SamplingConfig
    num_computed_tokens: int = 0    # tokens whose KV is already in the cache
    num_scheduled_tokens: int = 0   # tokens to run this step
    num_output_tokens: int = 0      # how many of token_ids are outputs (penalties read them)
    trace: TraceContext | None = None


@dataclass(slots=True)
class CachedRequest:
    """A running request's later plans: only new blocks and counts (the diff)."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int        # with speculative decoding a lower bound (step.proto)
    num_scheduled_tokens: int
    num_spec_tokens: int = 0        # draft tokens the worker may verify after this decode token


@dataclass(frozen=True, slots=True)
class TierBlocks:
    """A kvstore fetch into, or save from, one request's blocks (kv_tiers.py)."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    peer: str = ""                  # a direct hand-off: copy src_block_ids of this peer worker (kv_export.py)
    src_block_ids: list[int] | tuple = ()
    lease_deadline_ns: int = 0      # ... over before this Unix time, or it counts as failed


@dataclass(frozen=True, slots=True)
class LoadResult:
    """An ended kvstore fetch: its first num_loaded blocks hold their bytes."""

    request_id: str
    num_loaded: int
    num_requested: int
    bytes: int = 0
    duration_ns: int = 0


@dataclass(frozen=True, slots=True)
class SaveResult:
    """An ended kvstore save of one plan's blocks of one request."""

    request_id: str
    num_blocks: int
    num_saved: int


_NONE: tuple = ()


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequest]
    cached_requests: list[CachedRequest]
    finished_ids: list[str]         # drop these requests' state before running the step
    # Why the wire refused part of this plan (bad sampling parameters); the plan then carries no
    # requests and a runner rejects it whole, so the reply keeps its step id and its place in order.
    invalid: str = ""
    # KV tiers (step.proto, kv_tiers.py): (block, host slot) copies before the forward, kvstore
    # fetches to start, blocks to save after the forward.
    host_offloads: list[tuple[int, int]] | tuple = _NONE
    host_loads: list[tuple[int, int]] | tuple = _NONE
    tier_loads: list[TierBlocks] | tuple = _NONE
    tier_saves: list[TierBlocks] | tuple = _NONE

    @property
    def has_tier_work(self) -> bool:
        return bool(self.host_offloads or self.host_loads or self.tier_loads or self.tier_saves)


@dataclass(frozen=True, slots=True)
class Hello:
    """A (re)connecting scheduler: start from an empty block pool of this block size."""

    block_size: int


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]    # [(token_id, logprob)] best first


@dataclass(slots=True)
class PromptLogprob:
    position: int                   # the scored prompt token's index (>= 1)
    token_id: int
    logprob: float
    rank: int                       # 1 = the most likely token there
    top: list[tuple[int, float]]    # [(token_id, logprob)] best first


@dataclass(slots=True)
class SampledOutput:
    request_id: str
    token_ids: list[int]            # empty: a prompt chunk short of the prompt's end
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[PromptLogprob] | None = None   # the prompt tokens this step scored
    num_draft_tokens: int = 0       # speculative decoding: drafts verified (token_ids = accepted + 1)


@dataclass(frozen=True, slots=True)
class StepError:
    code: str                       # INVALID_ARGUMENT or INTERNAL
    message: str


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[SampledOutput]
    forward_ns: int = 0
    error: StepError | None = None  # a failed step: the scheduler fails its requests, not the engine
    kv_loads: list[LoadResult] | tuple = _NONE   # kvstore fetches that ended since the last result
    kv_saves: list[SaveResult] | tuple = _NONE   # kvstore saves that ended since the last result

    @classmethod
    def failed(cls, step_id: int, code: str, message: str) -> "StepResult":
        return cls(step_id, [], 0, StepError(code, message))


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """The answer to a Hello: what the scheduler plans against."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_name: str
    device: str
    num_host_kv_blocks: int = 0     # tier-1 slots (--kv-offload-gb)
    kv_namespace: object | None = None   # kv.proto KvNamespace when it fetches and saves via a kvstore
    kv_export_addr: str = ""        # its WorkerControl address when peers may map its KV cache
