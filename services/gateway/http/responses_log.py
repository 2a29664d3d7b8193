"""The event log of a streamed background response: what its stream readers follow while it
runs, and what `GET /v1/responses/{id}?stream=true&starting_after=N` replays or follows.

Events are kept as SSE text, indexed by sequence number, up to `max_bytes` per log and a
`LogBudget` shared by the logs of all running responses (once a log closes its bytes go back to
the budget: the stored copy is the response store's to bound): past either, the log keeps no
more, and a reader that reaches its end stops there (the whole response is still stored: GET
without stream has it)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

MAX_EVENT_LOG_BYTES = 8 * 1024 * 1024


def sse_text(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class LogBudget:
    """Bytes the event logs of running responses may hold together."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes


class EventLog:
    def __init__(self, budget: LogBudget, max_bytes: int = MAX_EVENT_LOG_BYTES) -> None:
        self.texts: list[str] = []       # texts[i]: the event of sequence number i
        self.bytes, self.max_bytes, self.budget = 0, max_bytes, budget
        self.full = False                # past max_bytes: nothing more is kept
        self.closed = False
        self._changed = asyncio.Event()  # replaced on each change; readers hold the current one

    def append(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            text = sse_text(event)
            if self.full or self.bytes + len(text) > self.max_bytes or len(text) > self.budget.left:
                self.full = True
                break
            self.texts.append(text)
            self.bytes += len(text)
            self.budget.left -= len(text)
        self._wake()

    def close(self) -> None:
        if not self.closed:
            self.budget.left += self.bytes
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `after`, then each new one, until the log closes."""
        at = after + 1
        while True:
            changed = self._changed
            if at < len(self.texts):
                chunk, at = "".join(self.texts[at:]), len(self.texts)
                yield chunk
                continue
            if self.closed or self.full:
                return
            await changed.wait()


async def replay(texts: list[str], after: int = -1) -> AsyncIterator[str]:
    """A finished stream's events after sequence number `after`."""
    if after + 1 < len(texts):
        yield "".join(texts[after + 1:])
