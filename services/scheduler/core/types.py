"""Boundary value types of the scheduler core (converted to/from protobuf by the adapter)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NewRequestPlan:
    """A request the worker has no state for: everything it needs, sent once."""

    request_id: str
    token_ids: list[int]          # prompt + outputs so far (a resumed request has outputs)
    block_ids: list[int]
    sampling: Any                 # opaque to the core (a SamplingParams message)
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_output_tokens: int
    trace: Any = None


@dataclass(frozen=True)
class CachedRequestPlan:
    """A request the worker already holds: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_spec_tokens: int = 0      # draft tokens the worker may verify after this decode token


@dataclass(frozen=True)
class TierBlocks:
    """A kvstore fetch into, or save from, one request's blocks (step.proto KvTierBlocks)."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    peer: str = ""                # direct hand-off: copy src_block_ids of this worker instead
    src_block_ids: list[int] = field(default_factory=list)
    lease_deadline_ns: int = 0    # ... finished before this (Unix ns), or it counts as failed


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    cached_requests: list[CachedRequestPlan] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # request id -> (arrival_seq, num_preemptions) when planned; never sent to the worker.
    incarnations: dict[str, tuple[int, int]] = field(default_factory=dict)
    # KV tiers (step.proto): (block id, host slot) copies before the forward, kvstore fetches
    # started and blocks saved after it.
    host_offloads: list[tuple[int, int]] = field(default_factory=list)
    host_loads: list[tuple[int, int]] = field(default_factory=list)
    tier_loads: list[TierBlocks] = field(default_factory=list)
    tier_saves: list[TierBlocks] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(r.num_scheduled_tokens for r in self.new_requests)
                + sum(r.num_scheduled_tokens + r.num_spec_tokens for r in self.cached_requests))

    @property
    def scheduled_ids(self) -> list[str]:
        return [r.request_id for r in self.new_requests] + [r.request_id for r in self.cached_requests]

    def is_empty(self) -> bool:
        return not (self.new_requests or self.cached_requests or self.finished_ids or self.host_offloads
                    or self.host_loads or self.tier_loads or self.tier_saves)


@dataclass(frozen=True)
class SampledTokens:
    """What the worker sampled for one request. The adapter passes protobuf SampledOutput
    messages in its place: the core only reads these three attributes."""

    request_id: str
    token_ids: list[int]
    logprobs: Any = None          # opaque, passed through to the output
    prompt_logprobs: Any = ()     # opaque, gathered per request until its first token
    num_draft_tokens: int = 0     # speculative decoding: drafts verified (token_ids: accepted + 1)


@dataclass
class StepResult:
    step_id: int
    sampled: list[SampledTokens] = field(default_factory=list)
    error: str | None = None      # a failed step fails its requests, not the engine
    # Ended kvstore fetches (objects with request_id, num_loaded, num_requested: KvLoadResult)
    # and saves (request_id, num_blocks, num_saved: KvSaveResult), in plan order.
    kv_loads: list[Any] = field(default_factory=list)
    kv_saves: list[Any] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None   # None while running; see request.FinishReason
    error_code: str | None = None      # "invalid_argument", "unavailable", "internal"
    error_message: str = ""
    logprobs: list[Any] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int = -1
    # The whole prompt's, on the first-token output only (a shared empty default: no list per output).
    prompt_logprobs: Sequence[Any] = ()
    # Speculative decoding, on the finishing output: drafts verified for the request, and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # A prefill-only request's end: the leading prompt blocks handed off (-1: not one); direct:
    # the worker holding them (its WorkerControl address) and their ids, held until released.
    handoff_blocks: int = -1
    handoff_peer: str = ""
    handoff_block_ids: Sequence[int] = ()
    handoff_deadline_ns: int = 0       # set by the adapter (it has the clock): the lease's end
    # Set by the adapter on the first-token and finishing outputs (the core has no clock):
    # RequestTiming stamps (queued, first scheduled, first token, finished), Unix ns, 0 = not yet.
    timing: tuple[int, int, int, int] | None = None
