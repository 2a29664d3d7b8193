"""Client of the tokenizer service: unary Encode / ApplyChatTemplate, and one long-lived
Detokenize stream that carries one message per engine step for all requests."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb, telemetry
from services.common.grpc_server import channel
from services.gateway.errors import ApiError

log = logging.getLogger("meshllm.gateway.tokenizer")


class TokenizerClient:
    def __init__(self, address: str, timeout_s: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = channel(address, credentials=credentials)  # credentials: internal mTLS
        self._stub = pb.tokenizer_grpc.TokenizerStub(self._channel)
        self._health = hpb_grpc.HealthStub(self._channel)
        self._call = None                       # the Detokenize stream, opened lazily
        self._reader: asyncio.Task | None = None
        self._write_lock = asyncio.Lock()
        # Futures of sent Detokenize messages, oldest first: responses come back in order.
        self._waiting: deque[asyncio.Future] = deque()
        self._lost_listeners: list[Callable[[], None]] = []

    def add_stream_lost_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs whenever the Detokenize stream breaks (its state is gone)."""
        self._lost_listeners.append(callback)

    @property
    def has_stream(self) -> bool:
        return self._call is not None

    async def close(self) -> None:
        self._drop_stream(ApiError("unavailable", "the gateway is shutting down"))
        await self._channel.close()

    def drop_stream(self, reason: str) -> None:
        """Give up the Detokenize stream (a hung tokenizer): its requests fail now."""
        self._drop_stream(ApiError("unavailable", reason))

    async def is_ready(self) -> bool:
        """The tokenizer's grpc.health.v1 readiness."""
        try:
            resp = await self._health.Check(hpb.HealthCheckRequest(service="tokenizer"),
                                            timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == hpb.HealthCheckResponse.SERVING

    # --- unary calls -------------------------------------------------------------------

    async def get_info(self) -> "pb.tokenizer.TokenizerInfo":
        return await self._unary(self._stub.GetInfo, pb.tokenizer.TokenizerInfoRequest())

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        resp = await self._unary(self._stub.Encode, pb.tokenizer.EncodeRequest(
            texts=[text], add_special_tokens=add_special_tokens))
        if len(resp.results) != 1:
            raise ApiError("internal", "tokenizer returned a malformed Encode response")
        return list(resp.results[0].ids)

    async def apply_chat_template(self, messages: Sequence["pb.common.ChatMessage"],
                                  add_generation_prompt: bool = True,
                                  continue_final_message: bool = False, *, tools_json: str = "",
                                  chat_template_kwargs_json: str = "") -> list[int]:
        resp = await self._unary(self._stub.ApplyChatTemplate, pb.tokenizer.ChatTemplateRequest(
            messages=messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, tools_json=tools_json,
            chat_template_kwargs_json=chat_template_kwargs_json))
        return list(resp.token_ids)

    async def decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = True) -> list[str]:
        resp = await self._unary(self._stub.Decode, pb.tokenizer.DecodeRequest(
            sequences=[pb.common.TokenIds(ids=s) for s in sequences],
            skip_special_tokens=skip_special_tokens))
        return list(resp.texts)

    async def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        resp = await self._unary(self._stub.ConvertIdsToTokens,
                                 pb.tokenizer.IdsToTokensRequest(ids=ids))
        if len(resp.tokens) != len(ids):
            raise ApiError("internal", "tokenizer returned a malformed ConvertIdsToTokens response")
        return list(resp.tokens)

    async def get_config(self) -> "pb.tokenizer.TokenizerConfig":
        return await self._unary(self._stub.GetConfig, pb.tokenizer.TokenizerConfigRequest())

    async def _unary(self, method, request):
        try:
            # traceparent of the current request span: the tokenizer's spans hang under it
            return await method(request, timeout=self.timeout_s, metadata=telemetry.grpc_metadata())
        except grpc.aio.AioRpcError as err:
            raise ApiError.from_grpc(err, "tokenizer") from None

    # --- the Detokenize stream -----------------------------------------------------------

    async def detokenize(self, items: Sequence["pb.tokenizer.DetokenizeItem"]) -> asyncio.Future:
        """Send one message; returns a future of its response's outputs (in send order).

        Awaiting the send but not the response lets the caller pipeline engine steps."""
        fut = asyncio.get_running_loop().create_future()
        # Nobody awaits cleanup-only messages; don't warn about their failures.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        async with self._write_lock:
            try:
                if self._call is None:
                    self._open_stream()
                self._waiting.append(fut)
                await self._call.write(pb.tokenizer.DetokenizeRequest(items=items))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
                self._drop_stream(ApiError("unavailable", f"tokenizer unavailable: {err}"))
        return fut

    def _open_stream(self) -> None:
        self._call = self._stub.Detokenize()
        self._reader = asyncio.create_task(self._read(self._call), name="detokenize-reader")

    async def _read(self, call) -> None:
        reason = "the tokenizer closed the Detokenize stream"
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                if not self._waiting:
                    reason = "the tokenizer sent an unexpected Detokenize response"
                    break
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.set_result(list(resp.outputs))
        except grpc.aio.AioRpcError as err:
            reason = f"tokenizer unavailable: {err.details() or err.code().name}"
        except asyncio.CancelledError:
            return
        if self._call is call:
            log.warning("Detokenize stream lost: %s", reason)
            self._drop_stream(ApiError("unavailable", reason))

    def _drop_stream(self, error: ApiError) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(error)
        if call is not None:
            for callback in self._lost_listeners:
                callback()
