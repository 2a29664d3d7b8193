"""The gateway's HTTP server under hostile clients (guard/connections.py): a connection cap with
idle connections closed to make room, idle / head / body deadlines, strict framing and head
limits. One gateway with small limits in front of the shared mesh; raw sockets on 127.0.0.1."""
from __future__ import annotations

import select
import socket
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.gateway_proc import start_gateway

CAP = 16
IDLE_S, HEAD_S, BODY_S = 2.0, 1.5, 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gw(mesh):
    health_port = _free_port()
    g = start_gateway(mesh, "--max-connections", str(CAP), "--keep-alive-timeout-s", str(IDLE_S),
                      "--header-timeout-s", str(HEAD_S), "--body-timeout-s", str(BODY_S),
                      "--body-min-rate", "1024", "--health-port", str(health_port))
    g.health_port = health_port
    yield g
    g.stop()


def _connect(gw) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.http_port), timeout=5)


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float | None]:
    """Everything the server sends, and when (monotonic) it closed; None: still open at timeout."""
    data, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return data, time.monotonic()
        if not chunk:
            return data, time.monotonic()
        data += chunk
    return data, None


def _health_port_status(gw) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{gw.health_port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="gateway"), timeout=5).status


def _completion(gw, mesh) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{gw.http_port}/v1/completions", timeout=60,
                      json={"model": mesh.model_name, "prompt": "Hello", "max_tokens": 1})


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_idle_connections_past_the_limit_are_closed_while_health_and_a_completion_work(gw, mesh):
    socks = [_connect(gw) for _ in range(3 * CAP)]
    time.sleep(0.3)
    # The oldest idle connections were closed to make room for newer ones, long before IDLE_S.
    closed = sum(_read_until_closed(s, 0.05)[1] is not None for s in socks)
    assert closed >= 2 * CAP, closed
    assert httpx.get(f"http://127.0.0.1:{gw.http_port}/health", timeout=10).status_code == 200
    assert _completion(gw, mesh).status_code == 200
    assert _health_port_status(gw) == SERVING      # idle connections are not saturation
    for s in socks:
        s.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(gw):
    with _connect(gw) as s:
        start = time.monotonic()
        data, closed_at = _read_until_closed(s, IDLE_S + 3)
    assert data == b"" and closed_at is not None
    assert IDLE_S - 0.5 <= closed_at - start <= IDLE_S + 2


def test_a_head_sent_a_line_at_a_time_is_closed_at_the_header_deadline(gw):
    lines = [b"GET /health HTTP/1.1\r\n"] + [b"x-slow-%d: 1\r\n" % i for i in range(20)]
    with _connect(gw) as s:
        start, closed_at = time.monotonic(), None
        for line in lines:
            try:
                s.sendall(line)
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            data, closed_at = _read_until_closed(s, 0.5)
            if closed_at is not None:
                break
    assert closed_at is not None, "the slow head was never cut off"
    assert HEAD_S - 0.5 <= closed_at - start <= HEAD_S + 2.5


@pytest.mark.parametrize("head,sent", [
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
     b"content-length: 5000\r\n\r\n", b'{"model": "m", '),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
     b"transfer-encoding: chunked\r\n\r\n", b'f\r\n{"model": "m", \r\n'),
], ids=["content-length-larger-than-sent", "chunked-without-its-end"])
def test_a_stalled_body_is_closed_at_the_body_deadline(gw, head, sent):
    with _connect(gw) as s:
        s.sendall(head + sent)
        start = time.monotonic()
        data, closed_at = _read_until_closed(s, BODY_S + 4)
    assert closed_at is not None, "the stalled body was never cut off"
    assert closed_at - start <= BODY_S + 2.5
    assert b"200 OK" not in data


def test_every_connection_running_a_request_is_saturation_and_it_ends_with_the_body_deadline(gw):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 5000\r\n\r\n{")
    stalled = [_connect(gw) for _ in range(CAP)]
    for s in stalled:
        s.sendall(head)
    time.sleep(0.3)
    with _connect(gw) as extra:   # no idle connection to close: the new one is closed at accept
        data, closed_at = _read_until_closed(extra, 1.0)
        assert closed_at is not None and data == b""
    assert _health_port_status(gw) == NOT_SERVING   # the separate health port says why not ready
    for s in stalled:
        assert _read_until_closed(s, BODY_S + 4)[1] is not None
        s.close()
    deadline = time.monotonic() + 5
    while _health_port_status(gw) != SERVING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health_port_status(gw) == SERVING
    assert httpx.get(f"http://127.0.0.1:{gw.http_port}/health", timeout=10).status_code == 200


def test_content_length_with_transfer_encoding_is_a_400_and_the_connection_closes(gw):
    smuggled = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")   # pipelined behind it: never answered
    with _connect(gw) as s:
        s.sendall(smuggled)
        data, closed_at = _read_until_closed(s, 5)
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]
    assert data.count(b"HTTP/1.1 ") == 1 and b"connection: close" in data.lower()
    assert closed_at is not None


@pytest.mark.parametrize("headers,why", [
    (b"".join(b"a%d:b\r\n" % i for i in range(10_000)), b"10000 headers"),   # ~80 KB, one send
    (b"".join(b"a%d:b\r\n" % i for i in range(150)), b"151 headers"),        # with host: small, one read
    (b"x-big: " + b"v" * 20_000 + b"\r\n", b"bytes"),
], ids=["10000-headers", "150-headers", "20KB-header"])
def test_a_head_over_the_limits_in_one_piece_is_a_431(gw, headers, why):
    with _connect(gw) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")
        data, closed_at = _read_until_closed(s, 5)
    assert closed_at is not None
    # A head larger than h11's buffer bound may be cut off (and answered) before its end.
    assert data.startswith(b"HTTP/1.1 431 "), data[:200]
    if b"headers" in why and len(headers) < 16 * 1024:
        assert why in data


def test_a_large_head_in_many_pieces_is_a_431(gw):
    with _connect(gw) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        try:
            for i in range(400):
                s.sendall(b"x-piece-%03d: %s\r\n" % (i, b"v" * 40))
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, closed_at = _read_until_closed(s, 5)
    assert closed_at is not None
    assert data.startswith(b"HTTP/1.1 431 ") or data == b"", data[:200]


def test_refusals_are_counted_in_a_few_log_lines_not_a_traceback_each(gw):
    socks = [_connect(gw) for _ in range(4 * CAP)]
    for s in socks:
        s.close()
    for _ in range(20):
        with _connect(gw) as s:
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n")
            _read_until_closed(s, 2)
    time.sleep(0.2)
    log = gw.log()
    assert "Traceback" not in log
    assert "Invalid HTTP request received" not in log
    assert log.count("HTTP connections in the last") <= 6   # one line per 10 s at most
