"""One request's scheduling state: token counts, blocks and stop conditions."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOOKUP = "lookup"      # asking the kvstore how much of its prompt it holds (not queued yet)
    LOADING = "loading"    # admitted, its blocks filling from the kvstore (not scheduled yet)
    RUNNING = "running"
    HANDOFF = "handoff"    # prefill-only: first token out, waiting for its blocks' saves (docs/pd.md)
    FINISHED = "finished"


class FinishReason:
    STOP = "stop"          # EOS or a stop token id
    LENGTH = "length"      # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)  # identity equality: requests are compared in list.remove/index
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int                           # >= 1, resolved by the gateway (EngineSubmit)
    sampling: Any = None                      # opaque SamplingParams, forwarded to the worker
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0                         # lower runs first under the priority policy
    cache_salt: str = ""                      # requests with different salts never share blocks
    arrival_seq: int = 0                      # FCFS order, set by the scheduler
    trace: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is computed or scheduled: advanced when a step is planned.
    num_computed_tokens: int = 0
    # Tokens sampled by planned steps whose results have not arrived (async scheduling).
    num_inflight_tokens: int = 0
    # Speculative decoding: draft slots of planned steps whose results have not arrived (how far
    # the worker may be past num_computed_tokens), and budgeted steps in a row it drafted none.
    spec_slack: int = 0
    spec_declined: int = 0
    spec_drafted: int = 0                     # drafts the worker verified for it, and those accepted
    spec_accepted: int = 0
    num_cached_prompt_tokens: int = 0         # prompt tokens not computed at first admission (any tier)
    # KV tiers: leading prompt blocks the kvstore holds (-1: not asked), the blocks of its
    # kvstore fetch (first index, count), and how many leading prompt blocks need no save.
    kv_tier_blocks: int = -1
    tier_load: tuple[int, int] = (0, 0)
    num_saved_blocks: int = 0
    dropped: bool = False                     # finished while LOADING: blocks freed when the fetch ends
    # Prefill/decode disaggregation (docs/pd.md): a prefill-only request ends after its first
    # token once every save batch of its prompt reported; saved_blocks counts the leading blocks
    # saved whole (a batch that lost any ends the count), handoff_ns when its first token left.
    prefill_only: bool = False
    pending_saves: int = 0
    saved_blocks: int = 0
    saves_broken: bool = False
    handoff: bool = False                     # a decode engine's request: its prompt was prefilled elsewhere
    peer: str = ""                            # ... directly: copy src_block_ids of that worker (docs/pd.md)
    src_block_ids: list[int] = field(default_factory=list)
    lease_deadline_ns: int = 0                # ... held there until then (Unix ns)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0                # leading blocks registered in the prefix cache
    num_blocks_sent: int = 0                  # block ids the worker already knows
    worker_has_state: bool = False
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # vLLM's prompt_logprobs: the whole prompt must be computed (no prefix-cache hit); the
    # worker's per-position values (opaque) gather here until they leave with the first token.
    wants_prompt_logprobs: bool = False
    prompt_logprobs: list[Any] = field(default_factory=list, repr=False)
    # prompt + outputs, kept in step with output_token_ids by append_output() (hot path).
    all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus those the worker will have sampled by the next planned step."""
        return self.num_tokens + self.num_inflight_tokens

    def check_stop(self, token_id: int, eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
        """Finish reason after `token_id` was appended, or None to keep going."""
        n_out = len(self.output_token_ids)
        if n_out >= self.min_tokens:
            if not self.ignore_eos and token_id in eos_token_ids:
                return FinishReason.STOP
            if token_id in self.stop_token_ids:
                return FinishReason.STOP
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
