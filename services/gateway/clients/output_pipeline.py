"""From engine outputs read off the EngineStream to Deltas queued on request handles.

OutputBatches coming down are merged per request while the Detokenize pipeline is full (at
most MAX_DETOKENIZE_INFLIGHT messages outstanding): one Detokenize message then carries
every step read since the last one, one item per request, and each request gets one text
delta (after stop-string matching) for all those steps. When the gateway keeps up this is
one message per engine step; when it falls behind, its cost per token drops instead of a
backlog growing (vLLM's output collector merges the same way). A FIFO keeps Detokenize
responses in order.

This is the gateway's hot path (at concurrency 256 its event loop runs near a whole core):
the reader appends to `unsent` inline, and the loops here do one dict lookup and no await
per output."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from services.gateway.clients.request_handle import RequestHandle
from services.gateway.clients.tokenizer import TokenizerClient
from services.gateway.errors import ApiError

log = logging.getLogger("meshllm.gateway.engine")

MAX_DETOKENIZE_INFLIGHT = 1   # Detokenize messages outstanding; steps read meanwhile are merged


class MergedOutput:
    """Consecutive RequestOutputs of one request read as one (the attribute names of
    pb.engine.RequestOutput): their tokens and logprobs in order, the last one's finish."""

    __slots__ = ("request_id", "new_token_ids", "logprobs", "finish_reason", "error",
                 "num_cached_tokens", "stop_token_id", "timing", "prompt_logprobs")
    is_handoff = False

    def __init__(self, outs: list) -> None:
        last = outs[-1]
        self.request_id, self.finish_reason = last.request_id, last.finish_reason
        self.error, self.stop_token_id = last.error, last.stop_token_id
        self.new_token_ids, self.logprobs, self.num_cached_tokens = [], [], 0
        self.prompt_logprobs = []  # the engine sends them once, on the first-token output
        self.timing = None  # the latest scheduler timing stamps among them
        for o in outs:  # extend() copies a repeated field in C: a comprehension is 3x slower
            if o.HasField("timing"):
                self.timing = o.timing
            self.new_token_ids.extend(o.new_token_ids)
            if o.logprobs:
                self.logprobs.extend(o.logprobs)
            if o.prompt_logprobs:
                self.prompt_logprobs.extend(o.prompt_logprobs)
            if o.num_cached_tokens > self.num_cached_tokens:
                self.num_cached_tokens = o.num_cached_tokens


def rid_done(out, unsent: dict) -> bool:
    """Every output the prefill engine sent for this request has been delivered."""
    return out.request_id not in unsent


class RequestsOwner(Protocol):
    """What the pipeline needs of the engine client whose requests it delivers."""

    outstanding_tokens: int  # the router's load: lowered as tokens arrive

    def abort(self, request_id: str, error: ApiError | None = None) -> bool: ...

    def release_finished(self, handle: RequestHandle) -> None: ...

    def hand_over(self, handle: RequestHandle) -> None: ...


class OutputPipeline:
    """Outputs read -> (merged) Detokenize messages -> Deltas, in read order.

    `requests` is the owner's map of requests in flight (request id -> handle), read here to
    skip requests that ended since their outputs were read."""

    def __init__(self, owner: RequestsOwner, requests: dict[str, RequestHandle],
                 tokenizer: TokenizerClient) -> None:
        self._owner, self._requests, self._tokenizer = owner, requests, tokenizer
        # Outputs read but not yet sent to the tokenizer: request id -> its outputs, in order.
        # Keys are requests in flight (bounded by the owner's max_inflight_requests). The
        # stream reader appends to it directly, so take it anew after each await.
        self.unsent: dict[str, list] = {}
        self._inflight = 0                      # Detokenize messages not yet dispatched
        self._steps: asyncio.Queue = asyncio.Queue()   # (outputs, detokenize future, sent ns)
        self._flush_wake = asyncio.Event()

    def outputs_added(self) -> None:
        """The reader added to `unsent`: send them now if the pipeline has room, else they
        merge with what comes next until a Detokenize response frees it."""
        if self.unsent and self._inflight < MAX_DETOKENIZE_INFLIGHT:
            self._flush_wake.set()

    def discard(self, request_id: str) -> None:
        """Drop the outputs read for a request but not yet detokenized: nobody wants them."""
        self.unsent.pop(request_id, None)

    def clear(self) -> None:
        """The stream is gone: its requests end or move, their read outputs with them."""
        self.unsent.clear()

    async def run_flush(self) -> None:
        """The only sender of step Detokenize messages, so the FIFO matches the send order."""
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            while self.unsent and self._inflight < MAX_DETOKENIZE_INFLIGHT:
                unsent, self.unsent = self.unsent, {}
                outputs, items = [], []
                for rid, outs in unsent.items():
                    handle = self._requests.get(rid)
                    if handle is None:
                        continue  # aborted since it was read
                    out = outs[0] if len(outs) == 1 else MergedOutput(outs)
                    items.append(handle.detokenize_item(out))
                    outputs.append(out)
                if not items:
                    continue
                self._inflight += 1
                sent_ns = time.monotonic_ns()
                try:
                    fut = await self._tokenizer.detokenize(items)
                except Exception as err:  # a bug must not stall every stream
                    log.exception("sending a Detokenize message failed")
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(ApiError("internal", f"gateway error: {err!r}"))
                self._steps.put_nowait((outputs, fut, sent_ns))

    async def run_dispatch(self) -> None:
        """Detokenize responses, in send order, become each request's Delta."""
        owner, requests = self._owner, self._requests
        while True:
            outputs, fut, sent_ns = await self._steps.get()
            try:
                detok = {o.request_id: o for o in await fut}
                detok_ns = time.monotonic_ns() - sent_ns  # this round trip, for timing breakdowns
            except ApiError as err:
                for out in outputs:
                    owner.abort(out.request_id, err)
                continue
            finally:
                self._inflight -= 1
                if self.unsent:
                    self._flush_wake.set()
            for out in outputs:
                handle = requests.get(out.request_id)
                if handle is None:
                    continue
                try:
                    d = detok.get(out.request_id)
                    if handle.timing is not None:
                        handle.timing.on_output(out, detok_ns)
                    handle.deliver(out, d.text_delta if d else "",
                                   dict(d.token_strings) if d else None)
                except Exception as err:  # one bad output fails one request, not the gateway
                    log.exception("failed to deliver an output of %s", out.request_id)
                    owner.abort(out.request_id, ApiError("internal", f"gateway error: {err!r}"))
                    continue
                used = min(len(out.new_token_ids), handle.cost_left)
                handle.cost_left -= used
                owner.outstanding_tokens -= used
                if handle.finished:
                    owner.release_finished(handle)  # a stop string: it aborts it in the engine
                elif handle.handoff is not None and rid_done(out, self.unsent):
                    owner.hand_over(handle)          # its prefill engine is done: on to decode
