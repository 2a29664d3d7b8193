"""The HTTP server's connection guard: uvicorn's h11 protocol with a connection cap, deadlines
and strict framing (what uvicorn 0.54 + h11 0.16 do not do on their own, read in their source):

- No connection limit: `limit_concurrency` answers 503 only once a request head has arrived, by
  then the connection holds its file descriptor. Here a process-wide `ConnectionLedger` caps
  open connections well under RLIMIT_NOFILE. At the cap, a new connection closes the oldest
  *idle* one (no request running: just connected, head still arriving, or keep-alive; closing
  those is always allowed, nginx does the same when it runs out of connections); only when
  every connection runs a request is the new one closed at accept. Both are counted, and
  logged at most once per `LOG_EVERY_S`.
- The keep-alive timer starts only after a response, and is cancelled by the first byte: a
  connection that never sends anything, a head sent a byte a second, or a body that never
  ends holds the connection (and the handler) for good. Here: the idle timer also runs from
  connect, a head must be complete `header_timeout_s` after its first byte, and a body must
  bring `body_min_rate * body_timeout_s` bytes in every `body_timeout_s` window.
- h11's header limit (`max_incomplete_event_size`) applies only while a head is incomplete:
  a large head in one read (up to 256 KiB) is parsed whole, and nothing counts headers. Here
  every head is measured once parsed: over `max_headers` or `max_header_bytes` is a 431.
- h11 lets Transfer-Encoding win over Content-Length and keeps the connection; RFC 9112 §6.1
  says such a message may be a smuggling attempt and the connection must close: here a 400
  with `connection: close`, and whatever was pipelined behind it is never read.

TLS: a connection is counted from its `connection_made`, i.e. after the TLS handshake
(asyncio closes handshakes that take over 60 s)."""
from __future__ import annotations

import logging
import resource
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

log = logging.getLogger("meshllm.gateway.connections")

DEFAULT_MAX_CONNECTIONS = 8192
LOG_EVERY_S = 10.0  # at most one log line per this many seconds about refused / closed connections


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(requested: int, nofile: int) -> int:
    """The connection cap: `requested`, or (0) min(8192, nofile / 2). Half the descriptors stay
    for gRPC channels, the health server, logs and sockets being closed."""
    if requested == 0:
        return max(1, min(DEFAULT_MAX_CONNECTIONS, nofile // 2))
    if requested > nofile // 2:
        raise ValueError(f"--max-connections {requested} must be at most half the file "
                         f"descriptor limit (RLIMIT_NOFILE {nofile})")
    return requested


def accept_backlog(nofile: int) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go before
    any of them reaches `connection_made` (where the cap acts): cap + backlog stay under nofile."""
    return max(16, min(2048, nofile // 4))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    accept_backlog: int
    keep_alive_timeout_s: float  # idle: from connect, or after a response, to a request's first byte
    header_timeout_s: float      # first byte of a request head to its end
    body_timeout_s: float        # each window in which a body must bring ...
    body_min_rate: int           # ... at least this many bytes per second
    max_header_bytes: int
    max_headers: int


class ConnectionLedger:
    """The process's open HTTP connections, the idle ones in the order they became idle.
    Plain attributes only: the health thread reads `saturated` and `describe()`."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: set = set()
        self._idle: OrderedDict = OrderedDict()   # evictable, oldest first
        self.totals: Counter = Counter()
        self._pending: Counter = Counter()
        self._logged_at = self._first_pending = -LOG_EVERY_S

    @property
    def saturated(self) -> bool:
        """Every connection slot runs a request: new connections are being refused."""
        return len(self._open) - len(self._idle) >= self.max_connections

    def describe(self) -> str:
        return (f"saturated: all {self.max_connections} HTTP connections are running requests "
                f"(--max-connections), new connections are refused")

    def admit(self, conn) -> bool:
        if len(self._open) >= self.max_connections:
            if not self._idle:
                self.note("refused at the connection limit")
                return False
            victim, _ = self._idle.popitem(last=False)
            self._open.discard(victim)
            victim.transport.close()
            self.note("idle closed to make room")
        self._open.add(conn)
        self._idle[conn] = None
        return True

    def busy(self, conn) -> None:
        self._idle.pop(conn, None)

    def idle(self, conn) -> None:
        if conn in self._open:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def release(self, conn) -> None:
        self._open.discard(conn)
        self._idle.pop(conn, None)

    def note(self, what: str) -> None:
        """Count an event; log the counts at most once per LOG_EVERY_S (a flood of refusals
        must not become a flood of log lines)."""
        if not self._pending:
            self._first_pending = time.monotonic()
        self.totals[what] += 1
        self._pending[what] += 1
        self.flush_log()

    def flush_log(self) -> None:
        """Log the pending counts if the last line is LOG_EVERY_S old (also called on a timer,
        so the counts of a flood that has stopped are still told)."""
        now = time.monotonic()
        if self._pending and now - self._logged_at >= LOG_EVERY_S:
            log.warning("HTTP connections in the last %.0fs: %s (open %d, limit %d)",
                        now - self._first_pending,
                        ", ".join(f"{kind} {n}" for kind, n in sorted(self._pending.items())),
                        len(self._open), self.max_connections)
            self._pending.clear()
            self._logged_at = now


class _RefusedHead(h11.RemoteProtocolError):
    pass


class _WatchedConnection(h11.Connection):
    """h11's server connection that shows each head and body event to the protocol first."""

    def __init__(self, protocol: "GuardedH11Protocol", max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.protocol = protocol

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            self.protocol.refusal = (err.error_status_hint, str(err))
            raise
        kind = type(event)
        if kind is h11.Request:
            self.protocol.on_head(event)  # raises _RefusedHead
        elif kind is h11.Data:
            self.protocol.body_bytes += len(event.data)
        elif kind is h11.EndOfMessage:
            self.protocol.on_body_end()
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol under a ConnectionLedger and ConnectionLimits (set on a subclass
    by `protocol_class`: uvicorn constructs the protocol itself)."""

    ledger: ConnectionLedger
    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _WatchedConnection(self, self.limits.max_header_bytes)
        self.refusal: tuple[int, str] | None = None
        self.body_bytes = 0
        self._refused = False
        self._head_timer = self._body_timer = None

    def connection_made(self, transport) -> None:
        if not self.ledger.admit(self):
            self._refused = True
            transport.abort()
            return
        super().connection_made(transport)
        # uvicorn arms this only after a response: a connection that never speaks would stay.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc) -> None:
        if self._refused:
            return
        self.ledger.release(self)
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Still IDLE after parsing: a head has begun and not ended (a whole head never leaves
        # the connection IDLE: its response comes later, from a task), so its deadline starts.
        if self._head_timer is None and self.conn.their_state is h11.IDLE \
                and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_too_slow)

    def on_head(self, event: h11.Request) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        limits = self.limits
        size = len(event.method) + len(event.target)
        length = chunked = None
        for name, value in event.headers:  # names are lowercase; h11 checked Content-Length is digits
            size += len(name) + len(value) + 4
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = value
        if len(event.headers) > limits.max_headers or size > limits.max_header_bytes:
            self._refuse(431, f"the request head has {len(event.headers)} headers, {size} bytes "
                              f"(at most {limits.max_headers} headers, {limits.max_header_bytes} bytes)")
        if length is not None and chunked is not None:
            self._refuse(400, "Content-Length and Transfer-Encoding in one request "
                              "(RFC 9112 section 6.1): the connection is closed")
        self.ledger.busy(self)
        self.on_body_end()
        if chunked is not None or (length is not None and length.lstrip(b"0")):
            self.body_bytes = 0
            self._body_timer = self.loop.call_later(limits.body_timeout_s, self._check_body)

    def on_body_end(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _refuse(self, status: int, message: str):
        # Counted (and its log line rate-limited) by _QuietProtocolErrors: uvicorn logs it.
        self.refusal = (status, message)
        raise _RefusedHead(message, error_status_hint=status)

    def send_400_response(self, msg: str) -> None:
        """uvicorn sends every protocol error as a 400 'Invalid HTTP request received.': send the
        status and reason the refusal carries instead (431 for a head too large)."""
        status, reason = self.refusal or (400, msg)
        self.refusal = None
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                             reason=STATUS_PHRASES[status])))
            self.transport.write(self.conn.send(h11.Data(data=reason.encode("ascii", "replace"))))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass  # a response had already started: nothing more can be said on this connection
        self.transport.close()

    def _should_upgrade(self) -> bool:
        # No WebSocket routes here; an upgraded connection would also leave the ledger's view
        # (uvicorn hands the transport to another protocol) and keep its slot for good.
        return False

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.ledger.idle(self)  # before uvicorn starts a pipelined request, which marks it busy
        super().on_response_complete()

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.ledger.note("closed: request head too slow")
            self.transport.close()

    def _check_body(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        # A paused read is our back-pressure (the app is behind), not a slow client.
        if not self.flow.read_paused and \
                self.body_bytes < self.limits.body_min_rate * self.limits.body_timeout_s:
            self.ledger.note("closed: request body too slow")
            self.transport.close()
            return
        self.body_bytes = 0
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._check_body)


def protocol_class(limits: ConnectionLimits, ledger: ConnectionLedger) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("GatewayH11Protocol", (GuardedH11Protocol,), {"limits": limits, "ledger": ledger})


class _QuietProtocolErrors(logging.Filter):
    """uvicorn logs 'Invalid HTTP request received.' once per bad request: count those instead."""

    def __init__(self, ledger: ConnectionLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Invalid HTTP request received.":
            self.ledger.note("refused: bad request (400/431)")
            return False
        return True


def install_log_guards(loop, ledger: ConnectionLedger) -> None:
    """One log line per LOG_EVERY_S, not one per event, for what a hostile client can repeat:
    uvicorn's per-request protocol warnings and asyncio's accept failure (out of file
    descriptors), which it logs with a traceback on every retry, once a second."""
    logging.getLogger("uvicorn.error").addFilter(_QuietProtocolErrors(ledger))
    previous = loop.get_exception_handler()

    def handler(loop, context) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            ledger.note(f"accept failed ({context.get('exception')})")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
