"""One long-lived EngineStream to one scheduler, multiplexing every request.

Submits (and aborts) that arrive in the same event-loop turn go up as one SubmitBatch
(AbortBatch). OutputBatches coming down are read here and handed to the OutputPipeline
(output_pipeline.py), which merges, detokenizes and delivers them to each RequestHandle
(request_handle.py). A request the engine fails before its first token (the stream broke,
or the scheduler lost its worker) is handed off: `on_lost_before_first_token` (the pool)
may resubmit it, on the same handle, to another replica."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb, telemetry
from services.common.grpc_server import channel
from services.gateway.clients.output_pipeline import OutputPipeline
from services.gateway.clients.request_handle import RequestHandle
from services.gateway.clients.tokenizer import TokenizerClient
from services.gateway.errors import ApiError

log = logging.getLogger("meshllm.gateway.engine")

# A fixed 64 KiB receive window on the EngineStream (no BDP probing, which grows it to
# megabytes): when the gateway reads slower than the engine steps, the scheduler's write
# blocks after a few dozen steps and it merges the steps queued behind it into one message,
# instead of thousands of step messages waiting in HTTP/2 buffers (each read costs the same).
ENGINE_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0),
                          ("grpc.http2.lookahead_bytes", 64 * 1024)]


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
        # Prefill/decode disaggregation (docs/pd.md): a prefill-only request whose prefill is
        # done (or whose prefill engine was lost after its first token) goes on elsewhere.
        self.on_handoff: Callable[[RequestHandle, "pb.engine.KvHandoffResult | None"], bool] | None = None
        self._close_reason = ""
        self.tokenizer = tokenizer
        self.max_inflight_requests = max_inflight_requests
        self.info: "pb.engine.EngineInfo | None" = None
        self.connected = False
        self._channel = channel(address, ENGINE_CHANNEL_OPTIONS, credentials)  # credentials: internal mTLS
        self._stub = pb.engine_grpc.EngineStub(self._channel)
        self._health = hpb_grpc.HealthStub(self._channel)
        self._requests: dict[str, RequestHandle] = {}
        self._pending_submits: dict[str, "pb.engine.EngineSubmit"] = {}
        self._pending_aborts: list[str] = []
        self._wake = asyncio.Event()
        self._pipeline = OutputPipeline(self, self._requests, tokenizer)
        self._background: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        tokenizer.add_stream_lost_listener(self._on_tokenizer_lost)

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._connect_loop(), name="engine-connect"),
                       asyncio.create_task(self._pipeline.run_flush(), name="engine-detokenize"),
                       asyncio.create_task(self._pipeline.run_dispatch(), name="engine-dispatch")]

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
               priority: int = 0, kv_handoff: "pb.engine.KvHandoff | None" = None) -> RequestHandle:
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
                                        priority=priority, kv_handoff=kv_handoff)
        if telemetry.ENABLED:  # the current request span becomes the scheduler's parent
            tp, ts = telemetry.traceparent_of(telemetry.current_span())
            if tp:
                submit.trace.traceparent, submit.trace.tracestate = tp, ts
        handle = RequestHandle(self, submit)
        self._enqueue(handle)
        return handle

    def adopt(self, handle: RequestHandle) -> bool:
        """Take over a request another replica failed before its first token: same handle
        (its reader sees nothing), submitted again here. False if this replica can't."""
        if (not self.connected or handle.request_id in self._requests
                or len(self._requests) >= self.max_inflight_requests):
            return False
        handle.moved_to(self)
        handle.reset_for_resubmit()
        self._enqueue(handle)
        return True

    def continue_request(self, handle: RequestHandle, submit: "pb.engine.EngineSubmit") -> bool:
        """Take over a request a prefill engine handed off (docs/pd.md): same handle, same
        Detokenize state, the decode engine's submit. False if this replica can't."""
        if (not self.connected or handle.request_id in self._requests
                or len(self._requests) >= self.max_inflight_requests):
            return False
        handle.moved_to(self)
        handle.submit_msg = submit
        handle.engine_done = False
        self._enqueue(handle)
        return True

    def hand_over(self, handle: RequestHandle) -> None:
        """The prefill engine is done with `handle` (every output of it delivered): it leaves
        this client and goes on on a decode engine, or ends with an error if none takes it."""
        rid = handle.request_id
        if self._requests.get(rid) is not handle:
            return
        del self._requests[rid]
        self._pending_submits.pop(rid, None)
        self._pipeline.discard(rid)
        self._release(handle)
        handle.prefill_phase = False
        result, handle.handoff = handle.handoff, None
        trace = handle.submit_msg.trace
        if trace.traceparent:   # one span of the request's trace from here to the decode engine's first output
            handle.handoff_span = telemetry.start_span(
                "gateway.kv_handoff", traceparent=trace.traceparent, tracestate=trace.tracestate,
                attributes={"meshllm.request_id": rid, "meshllm.prefill_replica": self.replica_id,
                            "meshllm.kv.blocks": result.num_kv_blocks if result is not None else 0,
                            "meshllm.kv.direct": bool(result is not None and result.peer)})
        if result is not None and result.peer:
            # A direct hand-off: the prefill engine holds the blocks until told the decode engine
            # has them (its first output) or the request ended; then its lease is released here.
            handle.release_lease = lambda: self.release_lease(rid)
        if self.on_handoff is None or not self.on_handoff(handle, result):
            handle.fail(ApiError("unavailable", "no engine replica could take the request after its prefill"))
            if handle.close_detokenize():
                item = pb.tokenizer.DetokenizeItem(request_id=rid, finished=True)
                task = asyncio.create_task(self.tokenizer.detokenize([item]))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    def release_lease(self, request_id: str) -> None:
        """The decode engine has the blocks of a direct hand-off: the prefill engine may free them."""
        if self.connected:
            self._pending_aborts.append(request_id)
            self._wake.set()

    def abort(self, request_id: str, error: ApiError | None = None) -> bool:
        """Stop a request: drop it here, tell the engine and the detokenizer. Idempotent."""
        handle = self._requests.pop(request_id, None)
        if handle is None:
            return False
        self._release(handle)
        handle.fail(error or ApiError("cancelled", "request aborted"))
        self._forget(handle)
        return True

    def release_finished(self, handle: RequestHandle) -> None:
        """`handle` got its last Delta: drop it here, and stop it in the engine and the
        tokenizer when the gateway ended it first (a stop string)."""
        del self._requests[handle.request_id]
        self._release(handle)
        self._forget(handle)

    def fail_all(self, message: str) -> None:
        """End every request in flight with UNAVAILABLE (and abort it in the engine)."""
        self._fail_all(ApiError("unavailable", message))

    def move_unstarted(self) -> int:
        """This replica stopped taking work (drained, worker lost, hung): requests it has
        not produced a token for go to another replica (aborted here), so they neither
        wait for its recovery nor for a drain. Returns how many moved."""
        moved = 0
        for rid, handle in list(self._requests.items()):
            if handle.streamed or handle.engine_done:
                continue
            sent = rid not in self._pending_submits
            if self._hand_off(handle):
                moved += 1
                if sent:
                    self._pending_aborts.append(rid)
                    self._wake.set()
        return moved

    async def check_readiness(self, timeout_s: float) -> bool:
        """The scheduler's grpc.health.v1 readiness: True when it is SERVING."""
        try:
            resp = await self._health.Check(hpb.HealthCheckRequest(service="scheduler"),
                                            timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == hpb.HealthCheckResponse.SERVING

    async def reset_prefix_cache(self, timeout_s: float, tiers: bool = False) -> "pb.engine.ResetPrefixCacheResponse":
        """Engine.ResetPrefixCache on this replica (raises grpc.aio.AioRpcError); `tiers`: the
        KV tiers too."""
        return await self._stub.ResetPrefixCache(pb.engine.ResetPrefixCacheRequest(tiers=tiers),
                                                 timeout=timeout_s)

    # --- internals -------------------------------------------------------------------------

    def _enqueue(self, handle: RequestHandle) -> None:
        self._requests[handle.request_id] = handle
        self._pending_submits[handle.request_id] = handle.submit_msg
        handle.tried.append(self.replica_id)
        handle.cost_left = handle.cost_tokens
        self.outstanding_tokens += handle.cost_tokens
        self._wake.set()

    def _release(self, handle: RequestHandle) -> None:
        """The request left this client (finished, aborted, moved): drop its load."""
        self.outstanding_tokens -= handle.cost_left
        handle.cost_left = 0

    def _forget(self, handle: RequestHandle) -> None:
        """Release the engine's and the tokenizer's state of a request we stopped early."""
        rid = handle.request_id
        self._pipeline.discard(rid)
        if not handle.engine_done:
            handle.engine_done = True
            if self._pending_submits.pop(rid, None) is None:
                self._pending_aborts.append(rid)
                self._wake.set()
        if handle.close_detokenize():
            item = pb.tokenizer.DetokenizeItem(request_id=rid, finished=True)
            task = asyncio.create_task(self.tokenizer.detokenize([item]))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _fail_all(self, error: ApiError) -> None:
        for rid in list(self._requests):
            self.abort(rid, error)

    def _hand_off(self, handle: RequestHandle) -> bool:
        """Move a request that got no token yet to another replica (the pool decides)."""
        if handle.streamed or self.on_lost_before_first_token is None:
            return False
        rid = handle.request_id
        if self._requests.get(rid) is not handle:
            return False
        del self._requests[rid]
        pending = self._pending_submits.pop(rid, None)
        self._pipeline.discard(rid)
        self._release(handle)
        if self.on_lost_before_first_token(handle):
            return True
        handle.moved_to(self)  # nobody took it: it stays here, as it was
        self._requests[rid] = handle
        if pending is not None:
            self._pending_submits[rid] = pending
        handle.cost_left = handle.cost_tokens
        self.outstanding_tokens += handle.cost_tokens
        return False

    def _hand_off_or_fail(self, error: ApiError) -> None:
        """The stream is gone: requests with no token yet may go elsewhere, a prefill-only one
        past its first token goes on to decode (which recomputes the prompt), the rest fail
        now (an error event, never a hang)."""
        for rid, handle in list(self._requests.items()):
            if handle.prefill_phase and handle.streamed and handle.generated_ids and not handle.finished:
                handle.handoff = pb.engine.KvHandoffResult()   # nothing handed off: the decode engine recomputes
                self.hand_over(handle)
                continue
            if not self._hand_off(handle):
                self.abort(rid, error)

    def _on_tokenizer_lost(self) -> None:
        # The tokenizer dropped its incremental-decoding state: those requests can't go on.
        for rid, handle in list(self._requests.items()):
            if handle.detokenize_started:
                handle.close_detokenize()  # nothing left there to release
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
                    handle.engine_done = True  # the scheduler drops a closed stream's requests
                if writer is not None:
                    writer.cancel()
                if call is not None:
                    call.cancel()
                self._pending_submits.clear()
                self._pending_aborts.clear()
                self._pipeline.clear()
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
        pipeline, requests = self._pipeline, self._requests
        while True:
            batch = await call.read()
            if batch is grpc.aio.EOF:
                return
            unsent = pipeline.unsent  # the flusher swaps it for a fresh dict while we wait
            for out in batch.outputs:
                rid = out.request_id
                handle = requests.get(rid)
                if handle is None or handle.engine_done:
                    continue  # stopped here already (stop string, disconnect): drop
                if handle.prefill_phase and out.HasField("handoff"):
                    # The prefill engine's end (docs/pd.md): not the request's. Delivered like a
                    # token-less output; the pipeline hands the request over once it is.
                    handle.handoff = pb.engine.KvHandoffResult()
                    handle.handoff.CopyFrom(out.handoff)
                    handle.engine_done = True
                    out.finish_reason = unspecified
                    if handle.timing is not None:
                        handle.timing.on_output(out, 0)
                        handle.timing.on_handoff()
                    out.ClearField("timing")
                    outs = unsent.get(rid)
                    if outs is None:
                        unsent[rid] = [out]
                    else:
                        outs.append(out)
                    continue
                if out.new_token_ids:
                    handle.streamed = True
                elif (out.finish_reason == error_reason and out.error.code == unavailable
                      and not handle.streamed and rid not in unsent):
                    # The engine lost its worker before this request's first token.
                    handle.engine_done = True
                    if self._hand_off(handle):
                        continue
                if out.finish_reason != unspecified:
                    handle.engine_done = True  # nothing more comes; don't abort it
                outs = unsent.get(rid)
                if outs is None:
                    unsent[rid] = [out]
                else:
                    outs.append(out)
            pipeline.outputs_added()
