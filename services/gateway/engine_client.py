"""One long-lived EngineStream to one scheduler, multiplexing every request.

Submits (and aborts) that arrive in the same event-loop turn go up as one SubmitBatch
(AbortBatch). OutputBatches coming down are merged per request while the Detokenize
pipeline is full (at most MAX_DETOKENIZE_INFLIGHT messages outstanding): one Detokenize
message then carries every step read since the last one, one item per request, and each
request gets one text delta (after stop-string matching) for all those steps. When the
gateway keeps up this is one message per engine step; when it falls behind, its cost per
token drops instead of a backlog growing (vLLM's output collector merges the same way).
A FIFO keeps Detokenize responses in order."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from services.common import pb
from services.common.grpc_server import channel
from services.gateway.errors import ApiError
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer_client import TokenizerClient

log = logging.getLogger("meshllm.gateway.engine")

DETOKENIZE_PREFIX_TOKENS = 8  # prompt context so the first output token keeps its space
MAX_DETOKENIZE_INFLIGHT = 1   # Detokenize messages outstanding; steps read meanwhile are merged
# A fixed 64 KiB receive window on the EngineStream (no BDP probing, which grows it to
# megabytes): when the gateway reads slower than the engine steps, the scheduler's write
# blocks after a few dozen steps and it merges the steps queued behind it into one message,
# instead of thousands of step messages waiting in HTTP/2 buffers (each read costs the same).
ENGINE_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0),
                          ("grpc.http2.lookahead_bytes", 64 * 1024)]
_FINISH = {pb.common.FINISH_REASON_STOP: "stop", pb.common.FINISH_REASON_LENGTH: "length"}


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

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def extend(self, later: "Delta") -> None:
        """Fold the next (non-error) Delta of the same request into this one."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.token_strings.update(later.token_strings)
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class MergedOutput:
    """Consecutive RequestOutputs of one request read as one (the attribute names of
    pb.engine.RequestOutput): their tokens and logprobs in order, the last one's finish."""

    __slots__ = ("request_id", "new_token_ids", "logprobs", "finish_reason", "error",
                 "num_cached_tokens", "stop_token_id")

    def __init__(self, outs: list) -> None:
        last = outs[-1]
        self.request_id, self.finish_reason = last.request_id, last.finish_reason
        self.error, self.stop_token_id = last.error, last.stop_token_id
        self.new_token_ids, self.logprobs, self.num_cached_tokens = [], [], 0
        for o in outs:  # extend() copies a repeated field in C: a comprehension is 3x slower
            self.new_token_ids.extend(o.new_token_ids)
            if o.logprobs:
                self.logprobs.extend(o.logprobs)
            if o.num_cached_tokens > self.num_cached_tokens:
                self.num_cached_tokens = o.num_cached_tokens


class RequestHandle:
    """One request in flight: iterate it for Deltas; abort() if you stop listening."""

    def __init__(self, client: "EngineClient", request_id: str, prompt_ids: Sequence[int],
                 sampling: "pb.common.SamplingParams") -> None:
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_ids)
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.finished = False                 # no more deltas will come
        self._client = client
        self._prefix = list(prompt_ids[-DETOKENIZE_PREFIX_TOKENS:])
        self._skip_special = sampling.skip_special_tokens
        self._want_token_strings = sampling.HasField("logprobs")
        self._stop_token_ids = set(sampling.stop_token_ids)
        self._matcher = StopStringMatcher(list(sampling.stop), sampling.include_stop_str_in_output)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._index: int | None = None        # set by route_to: queue (index, Delta) pairs
        self._engine_done = False             # the engine will send nothing more
        self._detok_started = False
        self._detok_done = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while True:
            delta = await self._queue.get()
            yield delta
            if delta.last:
                return

    def abort(self) -> None:
        self._client.abort(self.request_id)

    def route_to(self, queue: asyncio.Queue, index: int) -> None:
        """Put (index, Delta) pairs into `queue` instead of iterating this handle: n choices
        share one queue without a task per choice."""
        while not self._queue.empty():
            queue.put_nowait((index, self._queue.get_nowait()))
        self._queue, self._index = queue, index

    # --- called by EngineClient ------------------------------------------------------------

    def _detokenize_item(self, out) -> "pb.tokenizer.DetokenizeItem":
        """`out`: a pb.engine.RequestOutput or a MergedOutput."""
        done = out.finish_reason != pb.common.FINISH_REASON_UNSPECIFIED
        item = pb.tokenizer.DetokenizeItem(request_id=self.request_id,
                                           new_token_ids=out.new_token_ids,
                                           skip_special_tokens=self._skip_special, finished=done)
        if self._want_token_strings and out.logprobs:
            ids = {lp.token_id for lp in out.logprobs}
            ids.update(t.token_id for lp in out.logprobs for t in lp.top)
            item.token_string_ids.extend(sorted(ids))
        if not self._detok_started:
            item.prefix_token_ids.extend(self._prefix)
            self._detok_started = True
        if done:
            self._detok_done = True
        return item

    def _deliver(self, out, text: str,
                 token_strings: dict[int, str] | None = None) -> None:
        self.num_completion_tokens += len(out.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        delta = Delta(text=self._matcher.feed(text), token_ids=list(out.new_token_ids),
                      logprobs=list(out.logprobs), num_cached_tokens=self.num_cached_tokens,
                      token_strings=token_strings or {})
        reason = out.finish_reason
        if self._matcher.stopped is not None:
            delta.finish_reason, delta.stop_reason = "stop", self._matcher.stopped
        elif reason in _FINISH:
            delta.text += self._matcher.flush()
            delta.finish_reason = _FINISH[reason]
            if out.stop_token_id in self._stop_token_ids:
                delta.stop_reason = out.stop_token_id
        elif reason == pb.common.FINISH_REASON_ERROR:
            delta.error = ApiError.from_engine(out.error)
        elif reason == pb.common.FINISH_REASON_ABORT:
            delta.error = ApiError("unavailable", "the engine aborted the request")
        elif not delta.text and not delta.token_ids:
            return
        self._push(delta)

    def _push(self, delta: Delta) -> None:
        if self.finished:
            return
        if delta.last:
            self.finished, self.finish_reason = True, delta.finish_reason or "error"
        self._queue.put_nowait(delta if self._index is None else (self._index, delta))


class EngineClient:
    def __init__(self, address: str, tokenizer: TokenizerClient,
                 max_inflight_requests: int = 4096) -> None:
        self.address = address
        self.tokenizer = tokenizer
        self.max_inflight_requests = max_inflight_requests
        self.info: "pb.engine.EngineInfo | None" = None
        self.connected = False
        self._channel = channel(address, ENGINE_CHANNEL_OPTIONS)
        self._stub = pb.engine_grpc.EngineStub(self._channel)
        self._requests: dict[str, RequestHandle] = {}
        self._pending_submits: dict[str, "pb.engine.EngineSubmit"] = {}
        self._pending_aborts: list[str] = []
        self._wake = asyncio.Event()
        self._steps: asyncio.Queue = asyncio.Queue()   # (outputs, detokenize future), in order
        # Outputs read but not yet sent to the tokenizer: request id -> its outputs, in order.
        # Keys are requests in flight (bounded by max_inflight_requests).
        self._unsent: dict[str, list] = {}
        self._detok_inflight = 0                       # Detokenize messages not yet dispatched
        self._flush_wake = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        tokenizer.on_stream_lost = self._on_tokenizer_lost

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._connect_loop(), name="engine-connect"),
                       asyncio.create_task(self._flush_loop(), name="engine-detokenize"),
                       asyncio.create_task(self._dispatch_loop(), name="engine-dispatch")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(ApiError("unavailable", "the gateway is shutting down"))
        await self._channel.close()

    # --- public API ------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_ids: Sequence[int],
               sampling: "pb.common.SamplingParams", *, cache_salt: str = "",
               priority: int = 0) -> RequestHandle:
        if not self.connected:
            raise ApiError("unavailable", "the engine is not reachable; try again shortly")
        if request_id in self._requests:
            raise ApiError("invalid_argument", f"request id {request_id!r} is already in use",
                           param="request_id")
        if len(self._requests) >= self.max_inflight_requests:
            raise ApiError("resource_exhausted",
                           f"too many requests in flight ({self.max_inflight_requests})")
        handle = RequestHandle(self, request_id, prompt_ids, sampling)
        self._requests[request_id] = handle
        self._pending_submits[request_id] = pb.engine.EngineSubmit(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
            cache_salt=cache_salt, priority=priority)
        self._wake.set()
        return handle

    def abort(self, request_id: str, error: ApiError | None = None) -> bool:
        """Stop a request: drop it here, tell the engine and the detokenizer. Idempotent."""
        handle = self._requests.pop(request_id, None)
        if handle is None:
            return False
        handle._push(Delta("", [], error=error or ApiError("cancelled", "request aborted")))
        self._forget(handle)
        return True

    def fail_all(self, message: str) -> None:
        """End every request in flight with UNAVAILABLE (and abort it in the engine)."""
        self._fail_all(ApiError("unavailable", message))

    # --- internals -------------------------------------------------------------------------

    def _forget(self, handle: RequestHandle) -> None:
        """Release the engine's and the tokenizer's state of a request we stopped early."""
        rid = handle.request_id
        self._unsent.pop(rid, None)  # read, not yet detokenized: nobody will want them
        if not handle._engine_done:
            handle._engine_done = True
            if self._pending_submits.pop(rid, None) is None:
                self._pending_aborts.append(rid)
                self._wake.set()
        if handle._detok_started and not handle._detok_done:
            handle._detok_done = True
            item = pb.tokenizer.DetokenizeItem(request_id=rid, finished=True)
            task = asyncio.create_task(self.tokenizer.detokenize([item]))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _fail_all(self, error: ApiError) -> None:
        for rid in list(self._requests):
            self.abort(rid, error)

    def _on_tokenizer_lost(self) -> None:
        # The tokenizer dropped its incremental-decoding state: those requests can't go on.
        for rid, handle in list(self._requests.items()):
            if handle._detok_started:
                handle._detok_done = True
                self.abort(rid, ApiError("unavailable", "lost the tokenizer's Detokenize stream"))

    async def _connect_loop(self) -> None:
        backoff = 0.2
        while True:
            reason = "the scheduler closed the EngineStream"
            call = writer = None
            try:
                self.info = await self._stub.GetEngineInfo(pb.engine.EngineInfoRequest(),
                                                           timeout=5.0)
                call = self._stub.EngineStream()
                writer = asyncio.create_task(self._write_loop(call), name="engine-writer")
                self.connected, backoff = True, 0.2
                log.info("EngineStream open to %s (model %s, max_model_len %d)", self.address,
                         self.info.model_name, self.info.max_model_len)
                await self._read_loop(call)
            except grpc.aio.AioRpcError as err:
                reason = f"{err.code().name}: {err.details()}"
            except Exception as err:  # a bug must not leave requests hanging forever
                log.exception("EngineStream reader failed")
                reason = f"internal error: {err!r}"
            finally:
                was_connected, self.connected = self.connected, False
                for handle in self._requests.values():
                    handle._engine_done = True  # the scheduler drops a closed stream's requests
                if writer is not None:
                    writer.cancel()
                if call is not None:
                    call.cancel()
                self._pending_submits.clear()
                self._pending_aborts.clear()
                self._unsent.clear()
                self._fail_all(ApiError("unavailable", f"lost the engine stream: {reason}"))
            if was_connected:
                log.warning("EngineStream to %s lost: %s", self.address, reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _write_loop(self, call) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._pending_aborts:
                    ids, self._pending_aborts = self._pending_aborts, []
                    await call.write(pb.engine.EngineRequest(
                        abort=pb.engine.AbortBatch(request_ids=ids)))
                if self._pending_submits:
                    subs = list(self._pending_submits.values())
                    self._pending_submits.clear()
                    await call.write(pb.engine.EngineRequest(
                        submit=pb.engine.SubmitBatch(requests=subs)))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            log.warning("EngineStream write failed: %s", err)
            call.cancel()  # the reader sees it and reconnects

    async def _read_loop(self, call) -> None:
        unspecified = pb.common.FINISH_REASON_UNSPECIFIED
        while True:
            batch = await call.read()
            if batch is grpc.aio.EOF:
                return
            unsent, requests = self._unsent, self._requests
            for out in batch.outputs:
                rid = out.request_id
                handle = requests.get(rid)
                if handle is None or handle._engine_done:
                    continue  # stopped here already (stop string, disconnect): drop
                if out.finish_reason != unspecified:
                    handle._engine_done = True  # nothing more comes; don't abort it
                outs = unsent.get(rid)
                if outs is None:
                    unsent[rid] = [out]
                else:
                    outs.append(out)
            if unsent and self._detok_inflight < MAX_DETOKENIZE_INFLIGHT:
                self._flush_wake.set()

    async def _flush_loop(self) -> None:
        """The only sender of step Detokenize messages, so the FIFO matches the send order."""
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            while self._unsent and self._detok_inflight < MAX_DETOKENIZE_INFLIGHT:
                unsent, self._unsent = self._unsent, {}
                outputs, items = [], []
                for rid, outs in unsent.items():
                    handle = self._requests.get(rid)
                    if handle is None:
                        continue  # aborted since it was read
                    out = outs[0] if len(outs) == 1 else MergedOutput(outs)
                    items.append(handle._detokenize_item(out))
                    outputs.append(out)
                if not items:
                    continue
                self._detok_inflight += 1
                try:
                    fut = await self.tokenizer.detokenize(items)
                except Exception as err:  # a bug must not stall every stream
                    log.exception("sending a Detokenize message failed")
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(ApiError("internal", f"gateway error: {err!r}"))
                self._steps.put_nowait((outputs, fut))

    async def _dispatch_loop(self) -> None:
        while True:
            outputs, fut = await self._steps.get()
            try:
                detok = {o.request_id: o for o in await fut}
            except ApiError as err:
                for out in outputs:
                    self.abort(out.request_id, err)
                continue
            finally:
                self._detok_inflight -= 1
                if self._unsent:
                    self._flush_wake.set()
            for out in outputs:
                handle = self._requests.get(out.request_id)
                if handle is None:
                    continue
                try:
                    d = detok.get(out.request_id)
                    handle._deliver(out, d.text_delta if d else "",
                                    dict(d.token_strings) if d else None)
                except Exception as err:  # one bad output fails one request, not the gateway
                    log.exception("failed to deliver an output of %s", out.request_id)
                    self.abort(out.request_id, ApiError("internal", f"gateway error: {err!r}"))
                    continue
                if handle.finished:
                    del self._requests[out.request_id]
                    self._forget(handle)  # a stop string: abort it in the engine
