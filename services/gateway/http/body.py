"""Reading a request's body and watching its client: what every route handler shares."""
from __future__ import annotations

import asyncio

from fastapi import Request

from services.gateway.errors import ApiError


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused past `limit` bytes (body_guard.py bounds the wire first)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError("unsupported_media", f"Content-Encoding {encoding!r} is not supported")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError("too_large", f"the request body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError("too_large", f"the request body is larger than {limit} bytes")
    return bytes(body)


async def _until_disconnect(request: Request) -> None:
    # The body is fully read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def watch(request: Request, handle, awaitable):
    """Await `awaitable`; if the client goes away first, abort `handle` (anything with
    `abort()`: a RequestHandle or a ChoiceGroup) and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        handle.abort()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    handle.abort()
    raise ClientGone()
