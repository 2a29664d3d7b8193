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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from services.common import pb, telemetry
from services.common.grpc_server import channel
from services.gateway.errors import ApiError
from services.gateway.openai.stop_strings import StopStringMatcher
from services.gateway.clients.tokenizer import TokenizerClient

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
                 "num_cached_tokens", "stop_token_id", "timing")

    def __init__(self, outs: list) -> None:
        last = outs[-1]
        self.request_id, self.finish_reason = last.request_id, last.finish_reason
        self.error, self.stop_token_id = last.error, last.stop_token_id
        self.new_token_ids, self.logprobs, self.num_cached_tokens = [], [], 0
        self.timing = None  # the latest scheduler timing stamps among them
        for o in outs:  # extend() copies a repeated field in C: a comprehension is 3x slower
            if o.HasField("timing"):
                self.timing = o.timing
            self.new_token_ids.extend(o.new_token_ids)
            if o.logprobs:
                self.logprobs.extend(o.logprobs)
            if o.num_cached_tokens > self.num_cached_tokens:
                self.num_cached_tokens = o.num_cached_tokens


class RequestHandle:
    """One request in flight: iterate it for Deltas; abort() if you stop listening."""

    def __init__(self, client: "EngineClient", request_id: str, prompt_ids: Sequence[int],
                 sampling: "pb.common.SamplingParams",
                 submit: "pb.engine.EngineSubmit | None" = None) -> None:
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
        self.timing = None                    # a timing.HandleTiming when the client asked
        # Kept so the pool can resubmit it elsewhere if its engine dies before any token.
        self._submit = submit
        self.cost_tokens = len(prompt_ids) + sampling.max_tokens  # the router's load unit
        self._cost_left = self.cost_tokens
        self._streamed = False                # the engine sent at least one token
        self.tried: list[str] = []            # replica ids this request was sent to, in order

    @property
    def replica_id(self) -> str:
        return self._client.replica_id

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
            if self._submit is not None and self._submit.trace.traceparent:
                item.trace.CopyFrom(self._submit.trace)  # parent of the tokenizer's detokenize span
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
                 max_inflight_requests: int = 4096, replica_id: str = "",
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.replica_id = replica_id or address
        # prompt + max_tokens - generated over the requests in flight here (the router's load)
        self.outstanding_tokens = 0
        # Called for each request whose engine failed it before any token (stream lost, or
        # the scheduler's UNAVAILABLE): returns True when it resubmitted it elsewhere.
        self.on_lost_before_first_token: Callable[[RequestHandle], bool] | None = None
        self._close_reason = ""
        self.tokenizer = tokenizer
        self.max_inflight_requests = max_inflight_requests
        self.info: "pb.engine.EngineInfo | None" = None
        self.connected = False
        self._channel = channel(address, ENGINE_CHANNEL_OPTIONS, credentials)  # credentials: internal mTLS
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
        tokenizer.add_stream_lost_listener(self._on_tokenizer_lost)

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._connect_loop(), name="engine-connect"),
                       asyncio.create_task(self._flush_loop(), name="engine-detokenize"),
                       asyncio.create_task(self._dispatch_loop(), name="engine-dispatch")]

    async def close(self, reason: str = "the gateway is shutting down") -> None:
        self._close_reason = reason
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(ApiError("unavailable", reason))
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
        submit = pb.engine.EngineSubmit(request_id=request_id, prompt_token_ids=prompt_ids,
                                        sampling=sampling, cache_salt=cache_salt,
                                        priority=priority)
        if telemetry.ENABLED:  # the current request span becomes the scheduler's parent
            tp, ts = telemetry.traceparent_of(telemetry.current_span())
            if tp:
                submit.trace.traceparent, submit.trace.tracestate = tp, ts
        handle = RequestHandle(self, request_id, prompt_ids, sampling, submit)
        self._enqueue(handle)
        return handle

    def adopt(self, handle: RequestHandle) -> bool:
        """Take over a request another replica failed before its first token: same handle
        (its reader sees nothing), submitted again here. False if this replica can't."""
        if (not self.connected or handle.request_id in self._requests
                or len(self._requests) >= self.max_inflight_requests or handle._submit is None):
            return False
        handle._client = self
        handle._engine_done = handle._detok_started = handle._detok_done = False
        self._enqueue(handle)
        return True

    def _enqueue(self, handle: RequestHandle) -> None:
        self._requests[handle.request_id] = handle
        self._pending_submits[handle.request_id] = handle._submit
        handle.tried.append(self.replica_id)
        handle._cost_left = handle.cost_tokens
        self.outstanding_tokens += handle.cost_tokens
        self._wake.set()

    def _release(self, handle: RequestHandle) -> None:
        """The request left this client (finished, aborted, moved): drop its load."""
        self.outstanding_tokens -= handle._cost_left
        handle._cost_left = 0

    def abort(self, request_id: str, error: ApiError | None = None) -> bool:
        """Stop a request: drop it here, tell the engine and the detokenizer. Idempotent."""
        handle = self._requests.pop(request_id, None)
        if handle is None:
            return False
        self._release(handle)
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

    def _hand_off(self, handle: RequestHandle) -> bool:
        """Move a request that got no token yet to another replica (the pool decides)."""
        if handle._streamed or self.on_lost_before_first_token is None:
            return False
        rid = handle.request_id
        if self._requests.get(rid) is not handle:
            return False
        del self._requests[rid]
        pending = self._pending_submits.pop(rid, None)
        self._unsent.pop(rid, None)
        self._release(handle)
        if self.on_lost_before_first_token(handle):
            return True
        handle._client = self  # nobody took it: it stays here, as it was
        self._requests[rid] = handle
        if pending is not None:
            self._pending_submits[rid] = pending
        handle._cost_left = handle.cost_tokens
        self.outstanding_tokens += handle.cost_tokens
        return False

    def move_unstarted(self) -> int:
        """This replica stopped taking work (drained, worker lost, hung): requests it has
        not produced a token for go to another replica (aborted here), so they neither
        wait for its recovery nor for a drain. Returns how many moved."""
        moved = 0
        for rid, handle in list(self._requests.items()):
            if handle._streamed or handle._engine_done:
                continue
            sent = rid not in self._pending_submits
            if self._hand_off(handle):
                moved += 1
                if sent:
                    self._pending_aborts.append(rid)
                    self._wake.set()
        return moved

    def _hand_off_or_fail(self, error: ApiError) -> None:
        """The stream is gone: requests with no token yet may go elsewhere, the rest fail
        now (an error event, never a hang)."""
        for rid, handle in list(self._requests.items()):
            if not self._hand_off(handle):
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
                self._hand_off_or_fail(ApiError("unavailable", self._close_reason
                                                or f"lost the engine stream: {reason}"))
            if was_connected:
                log.warning("EngineStream to %s lost: %s", self.address, reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)  # a restarted scheduler is found within 2 s

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
        error_reason = pb.common.FINISH_REASON_ERROR
        unavailable = pb.common.ERROR_CODE_UNAVAILABLE
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
                if out.new_token_ids:
                    handle._streamed = True
                elif (out.finish_reason == error_reason and out.error.code == unavailable
                      and not handle._streamed and rid not in unsent):
                    # The engine lost its worker before this request's first token.
                    handle._engine_done = True
                    if self._hand_off(handle):
                        continue
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
                sent_ns = time.monotonic_ns()
                try:
                    fut = await self.tokenizer.detokenize(items)
                except Exception as err:  # a bug must not stall every stream
                    log.exception("sending a Detokenize message failed")
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(ApiError("internal", f"gateway error: {err!r}"))
                self._steps.put_nowait((outputs, fut, sent_ns))

    async def _dispatch_loop(self) -> None:
        while True:
            outputs, fut, sent_ns = await self._steps.get()
            try:
                detok = {o.request_id: o for o in await fut}
                detok_ns = time.monotonic_ns() - sent_ns  # this round trip, for timing breakdowns
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
                    if handle.timing is not None:
                        handle.timing.on_output(out, detok_ns)
                    handle._deliver(out, d.text_delta if d else "",
                                    dict(d.token_strings) if d else None)
                except Exception as err:  # one bad output fails one request, not the gateway
                    log.exception("failed to deliver an output of %s", out.request_id)
                    self.abort(out.request_id, ApiError("internal", f"gateway error: {err!r}"))
                    continue
                used = min(len(out.new_token_ids), handle._cost_left)
                handle._cost_left -= used
                self.outstanding_tokens -= used
                if handle.finished:
                    del self._requests[out.request_id]
                    self._release(handle)
                    self._forget(handle)  # a stop string: abort it in the engine
