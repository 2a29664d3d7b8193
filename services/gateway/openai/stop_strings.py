"""Stop-string detection on streamed, detokenized text. Pure: no I/O, no clocks.

A stop string can straddle token (and step) boundaries, so while streaming we hold back
the last len(longest stop) - 1 characters: they might be the start of a stop string.
The earliest-completing stop wins, so the result does not depend on how the text was
split into deltas."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to emit.

    After a stop string is found, `stopped` holds it and the text up to it (plus the stop
    string itself when `include_stop_str_in_output`) has been returned; later feeds
    return "". At the end of a request without a stop, `flush()` returns the held-back tail."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._include = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # received but not yet emitted; never contains a whole stop string
        self.stopped: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        if not self._stops:
            return delta
        buf = self._pending + delta
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self.stopped, self._pending = stop, ""
            return buf[:start + len(stop)] if self._include else buf[:start]
        cut = max(len(buf) - self._hold, 0)
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not hit a stop string."""
        tail, self._pending = self._pending, ""
        return "" if self.stopped is not None else tail

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        # Every match ends inside the newest delta (earlier buffers had none), and the
        # held-back tail is long enough to contain its start.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[1], best[2])
