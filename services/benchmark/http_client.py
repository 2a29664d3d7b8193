"""A small asyncio HTTP/1.1 client for streamed POSTs, with keep-alive connection reuse.

Why not httpx/aiohttp: on a 2-core box the load generator shares the CPU with the server it
measures; this client does one read and one split per network packet and nothing else, which
keeps its own cost per streamed token small (and it needs no extra dependency)."""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpStatusError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


class ConnectError(Exception):
    """Could not open a TCP (or TLS) connection to the server."""


class _Conn:
    reused = False   # taken from the keep-alive pool rather than freshly opened

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None, limit: int = 1024) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url must be http(s)://host[:port], got {base_url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {self.host}:{self.port}\r\nUser-Agent: meshllm-bench\r\n{extra}"
        self._idle: list[_Conn] = []
        self._limit = limit

    async def _connect(self, reuse: bool = True) -> _Conn:
        if reuse and self._idle:
            conn = self._idle.pop()
            conn.reused = True
            return conn
        try:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=ssl.create_default_context() if self.tls else None,
                limit=1 << 20)
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: "
                               f"{exc.strerror or exc}") from None
        return _Conn(reader, writer)

    async def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()

    async def get(self, path: str) -> tuple[int, bytes]:
        chunks = []
        status = 0
        async for status, data in self._request("GET", path, b""):
            chunks.append(data)
        return status, b"".join(chunks)

    async def post_stream(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) and yield the response body as it arrives, chunk by chunk.
        A non-2xx status raises HttpStatusError with the (whole) error body."""
        async for status, data in self._request("POST", path, body, raise_status=True):
            yield data

    async def _send_head(self, method: str, path: str, body: bytes) -> tuple[_Conn, bytes]:
        """Send the request; returns the connection and the status line. A kept-alive
        connection the server closed while idle fails before any status line: the
        request is then sent once more on a fresh connection (as browsers do)."""
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        data = head.encode("latin-1") + body
        conn = await self._connect()
        for fresh in (False, True):
            try:
                conn.writer.write(data)
                status_line = await conn.reader.readline()
            except (ConnectionError, OSError):
                status_line = b""
            if status_line or fresh or not conn.reused:
                return conn, status_line
            conn.close()
            conn = await self._connect(reuse=False)
        return conn, b""

    async def _request(self, method: str, path: str, body: bytes, raise_status: bool = False):
        conn, status_line = await self._send_head(method, path, body)
        reusable = False
        try:
            if not status_line:
                raise ConnectionResetError("the server closed the connection")
            status = int(status_line.split(b" ", 2)[1])
            length, chunked, close = -1, False, False
            while True:
                line = await conn.reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    close = b"close" in value.lower()
            body_iter = (_chunked(conn.reader) if chunked else _sized(conn.reader, length))
            if raise_status and not 200 <= status < 300:
                err = b"".join([d async for d in body_iter])
                reusable = not close and (chunked or length >= 0)
                raise HttpStatusError(status, err)
            async for data in body_iter:
                yield status, data
            reusable = not close and (chunked or length >= 0)
        finally:
            if reusable and len(self._idle) < self._limit:
                self._idle.append(conn)
            else:
                conn.close()


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size_line = await reader.readline()
        if not size_line:
            raise ConnectionResetError("the server closed the stream mid-response")
        size = int(size_line.split(b";", 1)[0], 16)
        if size == 0:
            await reader.readline()  # the final CRLF (no trailers)
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _sized(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
    if length >= 0:
        if length:
            yield await reader.readexactly(length)
        return
    while data := await reader.read(65536):
        yield data
