"""Pure ASGI middleware that bounds request bodies before any route reads them.

- The wire body is capped by `max_body_bytes` (Content-Length checked up front, chunked
  bodies counted as they arrive).
- `Content-Encoding: gzip | deflate | zstd` is decompressed as a stream: each compressed
  chunk is inflated with a bounded output size, and the request is refused with 413 as
  soon as the decompressed size passes `max_body_bytes` or the ratio decompressed /
  compressed passes `max_ratio` (past a small floor, since tiny bodies compress oddly).
  A 10 MB gzip of zeros that would expand to 10 GB is refused after inflating at most
  `max_body_bytes`, so memory stays flat.
- Routes downstream see an identity body (Content-Encoding removed, Content-Length set).

Pure ASGI (not BaseHTTPMiddleware): it only touches the request side; responses, SSE
streams included, pass straight through."""
from __future__ import annotations

import zlib

from services.gateway.errors import ApiError, send_asgi_error

_INFLATE_STEP = 64 * 1024           # most bytes one decompress call may produce
RATIO_FLOOR_BYTES = 1024 * 1024     # the ratio limit applies past this many output bytes
DRAIN_MAX_BYTES = 64 * 1024 * 1024  # a refused body is read and dropped up to this much ...
DRAIN_MAX_S = 5.0                   # ... or for this long, before the error is sent


class BodyRejected(Exception):
    def __init__(self, err: ApiError) -> None:
        super().__init__(err.message)
        self.err = err


def _too_large(what: str, limit: int) -> BodyRejected:
    return BodyRejected(ApiError("too_large", f"the request body {what} {limit} bytes"))


class _Zlib:
    """gzip (wbits 31) or deflate (zlib-wrapped, falling back to raw deflate)."""

    def __init__(self, encoding: str) -> None:
        self._gzip = encoding in ("gzip", "x-gzip")
        self._d = zlib.decompressobj(31 if self._gzip else 15)
        self._started = False

    def feed(self, data: bytes, budget: int) -> list[bytes]:
        """Inflate `data`; raises once the output would pass `budget` bytes."""
        if not self._started and not self._gzip and data:
            self._started = True
            # RFC 9110 "deflate" is zlib-wrapped, but some clients send raw deflate.
            if (data[0] & 0x0F) != 8 or ((data[0] << 8) | (data[1] if len(data) > 1 else 0)) % 31:
                self._d = zlib.decompressobj(-15)
        out, produced = [], 0
        while not self._d.eof:
            chunk = self._d.decompress(data, _INFLATE_STEP)
            produced += len(chunk)
            if produced > budget:
                raise OverflowError
            out.append(chunk)
            data = self._d.unconsumed_tail
            if not data and len(chunk) < _INFLATE_STEP:
                break  # all input consumed and no output pending
        return out

    def finish(self) -> None:
        if not self._d.eof:
            raise zlib.error("truncated stream")


class _Zstd:
    """zstd frames. zstandard's decompressobj has no output bound per call, so input is
    fed in small slices: one slice can expand at most to a few 128 KiB blocks."""

    _SLICE = 64

    def __init__(self) -> None:
        import zstandard
        self._d = zstandard.ZstdDecompressor(max_window_size=1 << 23).decompressobj()
        self._error = zstandard.ZstdError

    def feed(self, data: bytes, budget: int) -> list[bytes]:
        out, produced = [], 0
        try:
            for i in range(0, len(data), self._SLICE):
                chunk = self._d.decompress(data[i:i + self._SLICE])
                produced += len(chunk)
                if produced > budget:
                    raise OverflowError
                out.append(chunk)
        except self._error as err:
            raise zlib.error(str(err)) from None
        return out

    def finish(self) -> None:
        if not self._d.eof:
            raise zlib.error("truncated zstd frame")


def _decoder(encoding: str):
    if encoding in ("gzip", "x-gzip", "deflate"):
        return _Zlib(encoding)
    if encoding == "zstd":
        return _Zstd()
    return None


async def read_bounded(receive, encoding: str, max_body_bytes: int, max_ratio: float) -> bytes:
    """The whole (decompressed) body, or BodyRejected."""
    decoder = None if encoding in ("", "identity") else _decoder(encoding)
    if encoding not in ("", "identity") and decoder is None:
        raise BodyRejected(ApiError("unsupported_media", f"Content-Encoding {encoding!r} is "
                                    "not supported (gzip, deflate, zstd or identity)"))
    parts: list[bytes] = []
    wire = size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BodyRejected(ApiError("cancelled", "the client disconnected"))
        data = message.get("body", b"")
        wire += len(data)
        if wire > max_body_bytes:
            raise _too_large("is larger than", max_body_bytes)
        if decoder is None:
            parts.append(data)
            size = wire
        elif data:
            try:
                chunks = decoder.feed(data, max_body_bytes - size)
            except OverflowError:
                raise _too_large("decompresses to more than", max_body_bytes) from None
            except zlib.error as err:
                raise BodyRejected(ApiError("invalid_argument", f"the request body is not "
                                            f"valid {encoding}: {err}")) from None
            size += sum(len(c) for c in chunks)
            parts.extend(chunks)
            if size > RATIO_FLOOR_BYTES and size > max_ratio * wire:
                raise BodyRejected(ApiError("too_large", f"the request body's compression "
                                            f"ratio exceeds {max_ratio:g}"))
        if not message.get("more_body", False):
            break
    if decoder is not None:
        try:
            decoder.finish()
        except zlib.error as err:
            raise BodyRejected(ApiError("invalid_argument", f"the request body is not valid "
                                        f"{encoding}: {err}")) from None
    return b"".join(parts)


class BodyGuard:
    """ASGI middleware: bounded, decompressed request bodies for every HTTP route."""

    def __init__(self, app, max_body_bytes: int, max_ratio: float = 200.0) -> None:
        self.app, self.max_body_bytes, self.max_ratio = app, max_body_bytes, max_ratio

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        encoding, length = "", ""
        for k, v in headers:
            if k == b"content-encoding":
                encoding = v.decode("latin-1").strip().lower()
            elif k == b"content-length":
                length = v.decode("latin-1").strip()
        read_all = False

        async def tracked_receive():
            nonlocal read_all
            message = await receive()
            read_all = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        try:
            if length.isdigit() and int(length) > self.max_body_bytes:
                raise _too_large("is larger than", self.max_body_bytes)
            body = await read_bounded(tracked_receive, encoding, self.max_body_bytes,
                                      self.max_ratio)
        except BodyRejected as rejected:
            if rejected.err.kind == "cancelled":
                return
            if not read_all:
                read_all = await _drain(receive)
            # Unread input left behind: the connection can't be reused.
            return await send_asgi_error(send, rejected.err, scope,
                                         [] if read_all else [(b"connection", b"close")])
        new_headers = [(k, v) for k, v in headers
                       if k not in (b"content-encoding", b"content-length")]
        new_headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect can come

        await self.app({**scope, "headers": new_headers}, replay, send)


async def _drain(receive) -> bool:
    """Read and discard what is left of a refused body (bounded in bytes and time), so the
    error reaches the client: closing a socket with unread input makes the kernel send a
    reset, which can destroy the response before the client reads it. True if all was read."""
    import asyncio
    import time
    deadline = time.monotonic() + DRAIN_MAX_S
    drained = 0
    try:
        while drained <= DRAIN_MAX_BYTES:
            message = await asyncio.wait_for(receive(), max(0.01, deadline - time.monotonic()))
            if message["type"] != "http.request":
                return True
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
    except asyncio.TimeoutError:
        pass
    return False
