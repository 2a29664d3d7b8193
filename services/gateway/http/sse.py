"""The SSE side of streamed completions: folding queued deltas, and a lean ASGI response.

At 256 streams the gateway spends most of its CPU per SSE chunk (encode, the ASGI send
chain, one socket write each), so a stream that has fallen behind sends everything already
queued for it as one chunk per choice (OpenAI clients accept multi-token deltas; vLLM's
output collector merges the same way), and every event of one wake-up goes out in one send."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.gateway.clients.request_handle import Delta


def coalesce(pairs: list[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
    """Fold each choice's queued Deltas into as few as possible, keeping their order.

    A Delta with an error is never folded (the text before it is still sent as a chunk of
    its own, then the error event), and nothing is folded into a last Delta."""
    out: list[tuple[int, Delta]] = []
    open_at: dict[int, int] = {}  # choice index -> position in `out` of its foldable Delta
    for index, delta in pairs:
        at = open_at.get(index)
        if at is not None and delta.error is None:
            out[at][1].extend(delta)
        else:
            out.append((index, delta))
            at = len(out) - 1
        if out[at][1].last:
            open_at.pop(index, None)
        else:
            open_at[index] = at
    return out


class SSEResponse(Response):
    """200 text/event-stream from an async iterator of str: one ASGI send per item.

    StreamingResponse runs an anyio task group per response and cancels the stream when the
    client leaves; here one plain task watches for the disconnect and calls `on_disconnect`
    (which ends the iterator by aborting its requests), so no cancellation crosses the
    middleware stack."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], on_disconnect: Callable[[], None],
                 headers: Mapping[str, str] | None = None) -> None:
        self.body_iterator = content
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False

        async def watch() -> None:
            # The body was read before the response began: the next message is the disconnect
            # (uvicorn also answers it once the response is complete, hence `finished`).
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                self.on_disconnect()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for text in self.body_iterator:
                await send({"type": "http.response.body", "body": text.encode(),
                            "more_body": True})
            finished = True
            watcher.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            finished = True
            watcher.cancel()
            await self.body_iterator.aclose()  # no-op when exhausted; else runs its cleanup
