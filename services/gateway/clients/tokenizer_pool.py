"""Several tokenizer replicas behind one TokenizerClient-like interface, with failover.

Unary calls (Encode, ApplyChatTemplate, Decode, GetInfo) go to the active replica and, if it
answers UNAVAILABLE or times out, to the next ready one: a dead tokenizer costs the request
nothing but the retry. The Detokenize stream holds per-request decoding state, so it lives
on the active replica only; when it breaks (or the active replica stops answering its health
check, i.e. it hangs) the requests decoding on it end with an UNAVAILABLE error event, the
next ready replica becomes active and new requests go there."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc

from services.common import pb
from services.gateway.errors import ApiError
from services.gateway.clients.tokenizer import TokenizerClient

log = logging.getLogger("meshllm.gateway.tokenizer")

_RETRYABLE = ("unavailable", "deadline")


class TokenizerPool:
    def __init__(self, addresses: Sequence[str], timeout_s: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.timeout_s, self._credentials = timeout_s, credentials
        self._clients: dict[str, TokenizerClient] = {}
        self._ready: dict[str, bool] = {}
        self._active: str | None = None
        self._listeners: list[Callable[[], None]] = []
        self._closing: set[asyncio.Task] = set()
        self._closed = False
        self.set_addresses(addresses)

    # --- membership ----------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return list(self._clients)

    @property
    def active(self) -> str | None:
        return self._active

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Follow a changed replica set (the supervisor's): new ones join not-ready until
        their health check passes; removed ones are closed (their stream's requests fail)."""
        wanted = list(dict.fromkeys(addresses))
        for addr in wanted:
            if addr not in self._clients:
                client = TokenizerClient(addr, self.timeout_s, credentials=self._credentials)
                client.add_stream_lost_listener(lambda a=addr: self._on_stream_lost(a))
                self._clients[addr] = client
                self._ready[addr] = self._active is None  # the first one is tried at once
                if self._active is None:
                    self._active = addr
        for addr in [a for a in self._clients if a not in wanted]:
            client = self._clients.pop(addr)
            self._ready.pop(addr, None)
            if self._active == addr:
                self._active = None
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to close yet
                task = asyncio.get_running_loop().create_task(client.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        if self._active is None:
            self._switch()

    def add_stream_lost_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(c.close() for c in self._clients.values()),
                             return_exceptions=True)

    # --- health --------------------------------------------------------------------------

    async def is_ready(self) -> bool:
        """Check every replica; a hung or dead active one hands the stream to a ready one."""
        addrs = list(self._clients)
        results = await asyncio.gather(*(self._clients[a].is_ready() for a in addrs))
        for addr, ok in zip(addrs, results):
            if addr in self._ready:
                self._ready[addr] = ok
        active = self._active
        if active is None or not self._ready.get(active, False):
            client = self._clients.get(active) if active is not None else None
            if client is not None and client.has_stream:
                # Its requests' decoding state is stuck there: end them now, not never.
                client.drop_stream(f"tokenizer {active} stopped answering its health check")
            if self._active == active:  # (dropping the stream may have switched already)
                self._switch()
        return any(self._ready.values())

    def _switch(self) -> None:
        ready = [a for a, ok in self._ready.items() if ok and a != self._active]
        previous, self._active = self._active, (ready[0] if ready else self._active)
        if self._active is None and self._clients:
            self._active = next(iter(self._clients))
        if self._active != previous:
            log.warning("tokenizer replica %s is now active (was %s)", self._active, previous)

    def _on_stream_lost(self, addr: str) -> None:
        if addr == self._active and not self._closed:
            self._ready[addr] = False  # until its next health check says otherwise
            self._switch()
        for callback in self._listeners:
            callback()

    # --- calls ---------------------------------------------------------------------------

    def _order(self) -> list[TokenizerClient]:
        """The active replica first, then the other ready ones, then the rest."""
        addrs = sorted(self._clients, key=lambda a: (a != self._active, not self._ready.get(a)))
        return [self._clients[a] for a in addrs]

    async def _call(self, name: str, *args, **kwargs):
        last: ApiError | None = None
        for client in self._order():
            try:
                return await getattr(client, name)(*args, **kwargs)
            except ApiError as err:
                if err.kind not in _RETRYABLE:
                    raise
                last = err
                self._ready[client.address] = False
                if client.address == self._active:
                    self._switch()
        raise last or ApiError("unavailable", "no tokenizer replica is reachable")

    async def get_info(self) -> "pb.tokenizer.TokenizerInfo":
        return await self._call("get_info")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._call("encode", text, add_special_tokens)

    async def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                                  continue_final_message: bool = False, **kwargs) -> list[int]:
        return await self._call("apply_chat_template", messages, add_generation_prompt,
                                continue_final_message, **kwargs)

    async def decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return await self._call("decode", sequences, skip_special_tokens)

    async def convert_ids_to_tokens(self, ids) -> list[str]:
        return await self._call("convert_ids_to_tokens", ids)

    async def get_config(self) -> "pb.tokenizer.TokenizerConfig":
        return await self._call("get_config")

    async def detokenize(self, items) -> asyncio.Future:
        if self._active is None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(ApiError("unavailable", "no tokenizer replica is reachable"))
            return fut
        return await self._clients[self._active].detokenize(items)
