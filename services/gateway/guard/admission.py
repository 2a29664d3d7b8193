"""Admission control: the work the gateway has handed the engine is bounded by requests and
by tokens (prompt + max_tokens of each request in flight). Past either bound a new request
gets 429 (Retry-After) / RESOURCE_EXHAUSTED at once, before it reaches the engine, so the
requests already admitted keep their latency instead of queueing behind an unbounded
backlog. A request stops counting as soon as it finishes, fails or is aborted."""
from __future__ import annotations

from collections.abc import Callable

from services.gateway.errors import ApiError


SWEEP_EVERY = 256


class Admission:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        # request id -> (is it still in flight?, tokens it holds); bounded by max_requests.
        self._held: dict[str, tuple[Callable[[], bool], int]] = {}
        self.tokens = 0
        self._holds_since_sweep = 0

    def _sweep(self) -> None:
        for rid, (alive, tokens) in list(self._held.items()):
            if not alive():
                del self._held[rid]
                self.tokens -= tokens

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def check(self, num_requests: int, num_tokens: int) -> None:
        """Raise resource_exhausted unless `num_requests` more holding `num_tokens` fit."""
        if num_tokens > self.max_tokens:
            raise ApiError("invalid_argument", f"the request needs {num_tokens} tokens (prompt + "
                           f"max_tokens), more than this server admits at once "
                           f"({self.max_tokens}); lower max_tokens", param="max_tokens")
        if (len(self._held) + num_requests > self.max_requests
                or self.tokens + num_tokens > self.max_tokens):
            self._sweep()
        if len(self._held) + num_requests > self.max_requests:
            raise ApiError("resource_exhausted", f"the server is at its limit of "
                           f"{self.max_requests} requests in flight; retry shortly")
        if self.tokens + num_tokens > self.max_tokens:
            raise ApiError("resource_exhausted", f"the server is at its limit of "
                           f"{self.max_tokens} tokens in flight; retry shortly")

    def hold(self, request_id: str, tokens: int, alive: Callable[[], bool]) -> None:
        old = self._held.pop(request_id, None)
        if old is not None:
            self.tokens -= old[1]
        self._held[request_id] = (alive, tokens)
        self.tokens += tokens
        # Finished requests are dropped lazily; sweeping every SWEEP_EVERY holds (amortized
        # O(1)) keeps their handles from piling up to max_requests in an idle-ish gateway.
        self._holds_since_sweep += 1
        if self._holds_since_sweep >= SWEEP_EVERY:
            self._holds_since_sweep = 0
            self._sweep()
