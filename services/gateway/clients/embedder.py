"""Client of the embedder service (meshllm.v1.Embedder): GetInfo, cached, and Embed."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from services.common import pb, telemetry
from services.common.grpc_server import channel
from services.gateway.errors import ApiError

log = logging.getLogger("meshllm.gateway.embedder")


class EmbedderClient:
    def __init__(self, address: str, timeout_s: float = 60.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = channel(address, credentials=credentials)  # credentials: internal mTLS
        self._stub = pb.embed_grpc.EmbedderStub(self._channel)
        self.info: pb.embed.EmbedderInfo | None = None   # None until the embedder answered
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        """Learn the embedder's model (name, dimensions, limits) in the background, so
        /v1/models lists it as soon as it is up."""
        self._watcher = asyncio.create_task(self._fetch_info_until_known(), name="embedder-info")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self._channel.close()

    async def _fetch_info_until_known(self) -> None:
        while True:   # info goes back to None when the embedder becomes unreachable
            if self.info is None:
                with contextlib.suppress(ApiError):
                    await self.get_info(timeout_s=2.0)
            await asyncio.sleep(0.5 if self.info is None else 2.0)

    async def get_info(self, timeout_s: float | None = None) -> pb.embed.EmbedderInfo:
        if self.info is None:
            try:
                info = await self._stub.GetInfo(pb.embed.EmbedderInfoRequest(),
                                                timeout=timeout_s or self.timeout_s)
            except grpc.aio.AioRpcError as err:
                raise ApiError.from_grpc(err, "embedder") from None
            if self.info is None:
                log.info("embedder %s serves %r: dimensions=%d max_model_len=%d", self.address,
                         info.model_name, info.dimensions, info.max_model_len)
            self.info = info
        return self.info

    async def embed(self, request: pb.embed.EmbedBatchRequest) -> pb.embed.EmbedBatchResponse:
        # A cancelled caller cancels this call, and the embedder drops the queued items.
        try:
            return await self._stub.Embed(request, timeout=self.timeout_s,
                                          metadata=telemetry.grpc_metadata())  # parent of embedder.embed
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.info = None   # it may come back as another model: ask again
            raise ApiError.from_grpc(err, "embedder") from None
