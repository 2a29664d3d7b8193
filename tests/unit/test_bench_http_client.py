"""The bench's HTTP client survives a keep-alive connection the server closed while idle."""
from __future__ import annotations

import asyncio

from services.benchmark.http_client import HttpClient


async def _serve_once_per_connection(reader, writer):
    """Answer one request with keep-alive promised, then close (like an idle timeout)."""
    await reader.readuntil(b"\r\n\r\n")
    body = b'{"ok": true}'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    writer.close()


def test_a_request_on_a_connection_the_server_closed_is_retried_on_a_fresh_one():
    async def main():
        server = await asyncio.start_server(_serve_once_per_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = HttpClient(f"http://127.0.0.1:{port}")
        try:
            for _ in range(3):
                chunks = [c async for c in client.post_stream("/v1/x", b"{}")]
                assert b"".join(chunks) == b'{"ok": true}'
                await asyncio.sleep(0.05)  # the server has closed the pooled connection by now
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
