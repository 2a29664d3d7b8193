"""The per-response timing breakdown (`"return_timing": true` over HTTP, `return_timing` in
the gRPC GenerateRequest): where one request's time went, in milliseconds.

- queue, prefill, decode: the scheduler's stamps (engine.proto RequestTiming), differences
  on its own clock: submitted -> first scheduled -> first token -> finished. A request the
  gateway stopped on a stop string never gets the finishing stamp; its decode is then
  measured on the gateway's clock (first token delivered -> stop).
- tokenize: the gateway's Encode / ApplyChatTemplate call for the prompt.
- detokenize: the Detokenize round trips that carried this request's tokens. They overlap
  decode (the engine keeps stepping meanwhile), so the parts do not add up to total.
- total: the gateway received the request -> its last token was ready to send.

Nothing here runs unless a request asked: handles carry `timing = None` otherwise."""
from __future__ import annotations

import time

from services.common import pb


class HandleTiming:
    """What the gateway learns about one engine request as its outputs arrive."""

    __slots__ = ("detokenize_ns", "engine", "first_token_ns", "last_ns", "prefill_engine")

    def __init__(self) -> None:
        self.detokenize_ns = 0
        self.engine = None          # the latest pb.engine.RequestTiming seen
        self.prefill_engine = None  # a hand-off (docs/pd.md): the prefill engine's stamps
        self.first_token_ns = 0     # gateway monotonic clock
        self.last_ns = 0

    def on_handoff(self) -> None:
        """The request moves from its prefill engine to a decode engine."""
        self.prefill_engine, self.engine = self.engine, None

    def on_output(self, out, detokenize_ns: int) -> None:
        """`out`: a pb.engine.RequestOutput or MergedOutput, just detokenized."""
        now = time.monotonic_ns()
        self.detokenize_ns += detokenize_ns
        stamps = out.timing
        if stamps is not None and stamps.queued_unix_ns:
            self.engine = stamps
        if not self.first_token_ns and out.new_token_ids:
            self.first_token_ns = now
        self.last_ns = now


class RequestTimer:
    """One API request: when it arrived and how long its prompt took to tokenize."""

    def __init__(self) -> None:
        self.start_ns = time.monotonic_ns()
        self.tokenize_ns = 0

    def tokenize_started(self) -> int:
        return time.monotonic_ns()

    def tokenize_done(self, started_ns: int) -> None:
        self.tokenize_ns += time.monotonic_ns() - started_ns

    def breakdown(self, timing: HandleTiming) -> dict[str, float]:
        e = timing.engine
        queue = prefill = decode = transfer = 0.0
        p = timing.prefill_engine
        if p is not None:   # queue and prefill on the prefill engine, decode on the decode engine
            queue = max(0, p.first_scheduled_unix_ns - p.queued_unix_ns) / 1e6 if p.first_scheduled_unix_ns else 0.0
            if p.first_token_unix_ns and p.first_scheduled_unix_ns:
                prefill = (p.first_token_unix_ns - p.first_scheduled_unix_ns) / 1e6
            if p.finished_unix_ns and p.first_token_unix_ns:
                transfer = (p.finished_unix_ns - p.first_token_unix_ns) / 1e6
            if e is not None and e.first_scheduled_unix_ns:
                transfer += (e.first_scheduled_unix_ns - e.queued_unix_ns) / 1e6
                if e.finished_unix_ns:
                    decode = (e.finished_unix_ns - e.first_scheduled_unix_ns) / 1e6
        elif e is not None:
            if e.first_scheduled_unix_ns:
                queue = (e.first_scheduled_unix_ns - e.queued_unix_ns) / 1e6
            if e.first_token_unix_ns and e.first_scheduled_unix_ns:
                prefill = (e.first_token_unix_ns - e.first_scheduled_unix_ns) / 1e6
            if e.finished_unix_ns and e.first_token_unix_ns:
                decode = (e.finished_unix_ns - e.first_token_unix_ns) / 1e6
        if not decode and timing.first_token_ns:
            decode = (timing.last_ns - timing.first_token_ns) / 1e6
        end = timing.last_ns or time.monotonic_ns()
        return {"queue_ms": round(queue, 3), "prefill_ms": round(prefill, 3), "decode_ms": round(decode, 3),
                "tokenize_ms": round(self.tokenize_ns / 1e6, 3),
                "detokenize_ms": round(timing.detokenize_ns / 1e6, 3),
                "total_ms": round((end - self.start_ns) / 1e6, 3), "kv_transfer_ms": round(transfer, 3)}

    def breakdown_of_last(self, handles) -> dict[str, float]:
        """n choices: the breakdown of the choice that finished last (it bounds the response)."""
        return self.breakdown(max((h.timing for h in handles), key=lambda t: t.last_ns))

    def to_proto(self, timing: HandleTiming) -> "pb.generation.Timing":
        return pb.generation.Timing(**self.breakdown(timing))


def track(handles) -> None:
    """Start collecting timing on these engine requests (before their first output)."""
    for h in handles:
        h.timing = HandleTiming()
