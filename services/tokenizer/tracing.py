"""Detokenize spans: one per traced request on a Detokenize stream.

The stream multiplexes every request, so a request's parent comes in its first
DetokenizeItem (`trace`), not in gRPC metadata. The span opens at that item and closes at
the request's `finished` item (or when the stream closes), counting messages and tokens:
the cost of a span is paid once per request, plus two integer adds per item."""
from __future__ import annotations

import time

from services.common import telemetry


class _Open:
    __slots__ = ("span", "items", "tokens")

    def __init__(self, span) -> None:
        self.span, self.items, self.tokens = span, 0, 0


class DetokenizeSpans:
    """Per-stream map request id -> open span; bounded by `max_requests` and cleared with
    the stream (as the detokenizer's own state is)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._open: dict[str, _Open] = {}

    def on_item(self, item) -> None:
        rid = item.request_id
        entry = self._open.get(rid)
        if entry is None:
            if not item.trace.traceparent or len(self._open) >= self.max_requests:
                return
            span = telemetry.start_span("tokenizer.detokenize", traceparent=item.trace.traceparent,
                                        tracestate=item.trace.tracestate,
                                        attributes={"meshllm.request_id": rid})
            if span is None:
                return
            entry = self._open[rid] = _Open(span)
        entry.items += 1
        entry.tokens += len(item.new_token_ids)
        if item.finished:
            del self._open[rid]
            self._end(entry, finished=True)

    def clear(self) -> None:
        """The stream closed: end the spans of requests that never said finished."""
        entries, self._open = list(self._open.values()), {}
        now = time.time_ns()
        for entry in entries:
            self._end(entry, finished=False, end_ns=now)

    @staticmethod
    def _end(entry: _Open, finished: bool, end_ns: int | None = None) -> None:
        telemetry.end_span(entry.span, end_ns=end_ns, attributes={
            "meshllm.detokenize.messages": entry.items, "meshllm.detokenize.tokens": entry.tokens,
            "meshllm.detokenize.finished": finished})
