"""Stored responses (`store: true`): what GET /v1/responses/{id} returns and what a later
request's previous_response_id continues. Pure: the clock is passed in.

Bounded three ways (config: --responses-store-max-entries, --responses-store-max-bytes,
--responses-store-ttl-s): entries past the count or byte bound go least recently used first,
an entry past its time to live is gone, and one larger than the byte bound alone is not kept.
Entries live in the namespace of the API key that created them (guard/auth.py's principal: a
digest, never the key), so one key cannot read, continue or delete another's; with no API keys
configured every caller shares the one anonymous namespace."""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]                  # the response object, as GET returns it
    # The conversation after this response, as chat messages, for previous_response_id;
    # None while it is still running.
    history: list[dict[str, Any]] | None
    size: int
    expires_at: float
    input_items: list[dict[str, Any]] = field(default_factory=list)   # GET .../input_items
    events: list[str] | None = None    # a streamed background response's events, for replay


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl_s <= 0:
            raise ValueError("the response store needs max_entries >= 0, max_bytes >= 0, ttl_s > 0")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, response_id: str, body: dict[str, Any],
            history: list[dict[str, Any]] | None,
            input_items: list[dict[str, Any]] | None = None,
            events: list[str] | None = None) -> bool:
        """Keep (or replace) one response; False when it is not kept (store disabled, or the
        entry alone is over the byte bound)."""
        self.delete(owner, response_id)
        size = len(json.dumps(body)) + (len(json.dumps(history)) if history else 0) + \
            (len(json.dumps(input_items)) if input_items else 0) + sum(map(len, events or ()))
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self._entries[(owner, response_id)] = StoredResponse(
            body, history, size, self.clock() + self.ttl_s, input_items or [], events)
        self.bytes += size
        self._evict()
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        key = (owner, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self.clock():
            self.delete(owner, response_id)
            return None
        self._entries.move_to_end(key)
        return entry

    def find_item(self, owner: str, item_id: str) -> dict[str, Any] | None:
        """An input or output item of one of `owner`'s live stored responses, by id (the most
        recent response first; a scan: item references are rare, and the store is bounded)."""
        now = self.clock()
        for (who, _), entry in reversed(self._entries.items()):
            if who != owner or entry.expires_at <= now:
                continue
            for item in (*entry.body.get("output", ()), *entry.input_items):
                if item.get("id") == item_id:
                    return item
        return None

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _evict(self) -> None:
        # Expired entries at the least recently used end go first (a later get finds any other
        # expired one), then the LRU ones past the bounds: O(1) per put, not a scan.
        now = self.clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires_at > now and len(self._entries) <= self.max_entries \
                    and self.bytes <= self.max_bytes:
                return
            del self._entries[key]
            self.bytes -= entry.size
