"""One request in flight on an engine: what its reader sees (Deltas) and what the engine
client and the output pipeline keep about it (engine and Detokenize state, its load).

The reader iterates the handle (or routes it into a shared queue with `route_to`) and
calls `abort()` when it stops listening. The engine client owns everything else: it
submits `submit_msg`, marks `engine_done` / `streamed` as outputs arrive, accounts
`cost_left` as the router's load, and feeds each detokenized output to `deliver`."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from services.common import pb, telemetry
from services.gateway.errors import ApiError
from services.gateway.openai.finish import finish_of_output
from services.gateway.openai.prompt_logprobs import string_ids
from services.gateway.openai.stop_strings import StopStringMatcher

DETOKENIZE_PREFIX_TOKENS = 8  # prompt context so the first output token keeps its space


class HandleOwner(Protocol):
    """The engine client that holds a handle's request (an EngineClient), as the handle sees it."""

    replica_id: str

    def abort(self, request_id: str, error: ApiError | None = None) -> bool: ...


@dataclass
class Delta:
    """What one engine step produced for one request, after stop strings."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # "stop" | "length" on the last delta
    stop_reason: str | int | None = None      # the stop string or stop token id
    error: ApiError | None = None             # set on the last delta of a failed request
    logprobs: list = field(default_factory=list)
    num_cached_tokens: int = 0
    token_strings: dict[int, str] = field(default_factory=dict)  # ids in logprobs -> text
    # sampling.prompt_logprobs: the prompt's PromptLogprobs, on the request's first Delta
    prompt_logprobs: list = field(default_factory=list)

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def extend(self, later: "Delta") -> None:
        """Fold the next (non-error) Delta of the same request into this one."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.token_strings.update(later.token_strings)
        if later.prompt_logprobs:
            self.prompt_logprobs += later.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class RequestHandle:
    """One request in flight: iterate it for Deltas; abort() if you stop listening."""

    def __init__(self, client: HandleOwner, submit_msg: "pb.engine.EngineSubmit") -> None:
        sampling = submit_msg.sampling
        self.request_id = submit_msg.request_id
        self.num_prompt_tokens = len(submit_msg.prompt_token_ids)
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.finished = False                 # no more deltas will come
        self.timing = None                    # a timing.HandleTiming when the client asked
        # Kept so the pool can resubmit it elsewhere if its engine dies before any token.
        self.submit_msg = submit_msg
        self.tried: list[str] = []            # replica ids this request was sent to, in order
        # --- kept by the engine client: read and written on the hot path, so plain attributes
        self.cost_tokens = self.num_prompt_tokens + sampling.max_tokens  # the router's load unit
        self.cost_left = self.cost_tokens     # what the current replica still counts for it
        self.engine_done = False              # the engine will send nothing more
        self.streamed = False                 # the engine sent at least one token
        # Prefill/decode disaggregation (docs/pd.md): on a prefill engine until `handoff` (the
        # blocks it saved) arrives; its tokens so far go to the decode engine as resume tokens.
        self.prefill_phase = submit_msg.kv_handoff.prefill_only
        self.handoff = None                   # pb.engine.KvHandoffResult once the prefill engine is done
        self.generated_ids: list[int] = []
        self.release_lease = None             # direct hand-off: frees the prefill engine's blocks (once)
        self.handoff_span = None              # gateway.kv_handoff: prefill engine done -> decode's first output
        self._client = client
        self._prefix = list(submit_msg.prompt_token_ids[-DETOKENIZE_PREFIX_TOKENS:])
        self._skip_special = sampling.skip_special_tokens
        self._want_token_strings = sampling.HasField("logprobs")
        self._want_prompt_strings = sampling.HasField("prompt_logprobs")
        self._stop_token_ids = set(sampling.stop_token_ids)
        self._include_stop = sampling.include_stop_str_in_output
        self._matcher = StopStringMatcher(list(sampling.stop), sampling.include_stop_str_in_output)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._index: int | None = None        # set by route_to: queue (index, Delta) pairs
        self._detok_started = False
        self._detok_done = False

    @property
    def replica_id(self) -> str:
        return self._client.replica_id

    @property
    def prompt_token_ids(self):
        """The prompt as submitted (what the router matches prefixes on when it moves)."""
        return self.submit_msg.prompt_token_ids

    # --- the reader's side -----------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while True:
            delta = await self._queue.get()
            yield delta
            if delta.last:
                return

    def abort(self) -> None:
        self.release_now()
        self._client.abort(self.request_id)

    def release_now(self) -> None:
        """Release a direct hand-off's lease on the prefill engine (once; nothing otherwise)."""
        release, self.release_lease = self.release_lease, None
        if release is not None:
            release()

    def route_to(self, queue: asyncio.Queue, index: int) -> None:
        """Put (index, Delta) pairs into `queue` instead of iterating this handle: n choices
        share one queue without a task per choice."""
        while not self._queue.empty():
            queue.put_nowait((index, self._queue.get_nowait()))
        self._queue, self._index = queue, index

    # --- the engine client's side ----------------------------------------------------------

    def moved_to(self, client: HandleOwner) -> None:
        """`client` now holds this request (abort() goes there)."""
        self._client = client

    def reset_for_resubmit(self) -> None:
        """Submitted again on another replica: the old one's engine and Detokenize state
        are gone, the new one starts from the prompt."""
        self.engine_done = self._detok_started = self._detok_done = False

    @property
    def detokenize_started(self) -> bool:
        """The tokenizer holds incremental-decoding state for this request."""
        return self._detok_started

    def close_detokenize(self) -> bool:
        """Nothing more goes to the tokenizer for this request. True when its state there
        was never released by a finishing item, so the caller must send one."""
        release = self._detok_started and not self._detok_done
        self._detok_done = True
        return release

    def detokenize_item(self, out) -> "pb.tokenizer.DetokenizeItem":
        """`out`: a pb.engine.RequestOutput or a MergedOutput."""
        done = out.finish_reason != pb.common.FINISH_REASON_UNSPECIFIED
        ids = out.new_token_ids
        if (done and out.stop_token_id >= 0 and not self._include_stop and ids
                and ids[-1] == out.stop_token_id and out.finish_reason == pb.common.FINISH_REASON_STOP):
            # vLLM's rule: the token that stopped the request (EOS or a stop id) is not text,
            # special or not (with skip_special_tokens false, "<|im_end|>" would show otherwise).
            ids = ids[:-1]
        item = pb.tokenizer.DetokenizeItem(request_id=self.request_id, new_token_ids=ids,
                                           skip_special_tokens=self._skip_special, finished=done)
        if self._want_token_strings and out.logprobs:
            ids = {lp.token_id for lp in out.logprobs}
            ids.update(t.token_id for lp in out.logprobs for t in lp.top)
            item.token_string_ids.extend(sorted(ids))
        if self._want_prompt_strings and not self._detok_started:   # the first-token output
            ids = string_ids(self.submit_msg.prompt_token_ids, out.prompt_logprobs)
            ids.difference_update(item.token_string_ids)
            item.token_string_ids.extend(sorted(ids))
        if not self._detok_started:
            item.prefix_token_ids.extend(self._prefix)
            if self.submit_msg.trace.traceparent:
                item.trace.CopyFrom(self.submit_msg.trace)  # parent of the tokenizer's detokenize span
            self._detok_started = True
        if done:
            self._detok_done = True
        return item

    def deliver(self, out, text: str, token_strings: dict[int, str] | None = None) -> None:
        """The detokenized `text` of `out` (a pb.engine.RequestOutput or a MergedOutput):
        count its tokens, match stop strings, and queue its Delta if it has one."""
        self.num_completion_tokens += len(out.new_token_ids)
        if self.prefill_phase:
            self.generated_ids.extend(out.new_token_ids)
        else:
            if self.release_lease is not None:   # the decode engine's first output: it has the blocks
                self.release_now()
            if self.handoff_span is not None:
                self.end_handoff_span()
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        matcher = self._matcher
        text = matcher.feed(text)
        end = finish_of_output(out, text, matcher.stopped, self._stop_token_ids)
        if end is None:
            return
        if end.flush_held_text:
            text += matcher.flush()
        # Positional, in Delta's field order: this runs for every output of every request.
        self._push(Delta(text, list(out.new_token_ids), end.reason, end.stop_reason, end.error,
                         list(out.logprobs), self.num_cached_tokens, token_strings or {},
                         list(out.prompt_logprobs) if out.prompt_logprobs else []))

    def end_handoff_span(self, error: str | None = None) -> None:
        span, self.handoff_span = self.handoff_span, None
        telemetry.end_span(span, error=error, attributes={"meshllm.decode_replica": self.replica_id})

    def fail(self, error: ApiError) -> None:
        """End the reader's stream with `error` (nothing, if it has ended already)."""
        self.release_now()
        if self.handoff_span is not None:
            self.end_handoff_span(error.message)
        self._push(Delta("", [], error=error))

    def _push(self, delta: Delta) -> None:
        if self.finished:
            return
        if delta.last:
            self.finished, self.finish_reason = True, delta.finish_reason or "error"
        self._queue.put_nowait(delta if self._index is None else (self._index, delta))
