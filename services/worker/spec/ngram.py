"""N-gram prompt lookup: the proposal for a request is what followed the most recent earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min), up to k
tokens. Incremental: each appended token adds one entry per n to a map from n-gram to the index
right after its latest occurrence, so a proposal costs O(max - min) lookups, never a scan of the
whole context (a scan of an 8k-token context for every request of every step would cost more
than the step).

The map only holds n-grams that already have a continuation (the n-gram ending at the previous
token, mapped to the index of the newest one), so the request's current suffix never matches
itself. Tokens are indexed when a proposal is asked for, not when they arrive: while the device
proposes (spec/device_steps.py) the host only keeps the tokens, for the steps that fall back to it."""
from __future__ import annotations


class NgramProposer:
    """One request's n-gram index over its tokens (prompt + outputs)."""

    __slots__ = ("n_min", "n_max", "tokens", "_last", "_indexed")

    def __init__(self, n_min: int, n_max: int, tokens: list[int] | None = None) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = list(tokens or [])
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0          # tokens [0, _indexed) are in _last as continuations

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)

    def _index(self) -> None:
        toks, last = self.tokens, self._last
        for j in range(max(1, self._indexed), len(toks)):   # j: the continuation of every n-gram ending at j - 1
            for n in range(self.n_min, min(self.n_max, j) + 1):
                last[tuple(toks[j - n:j])] = j
        self._indexed = len(toks)

    def truncate(self, length: int) -> None:
        """Forget tokens past `length` (rejected drafts appended by mistake; a rare path: rebuilds)."""
        if length < len(self.tokens):
            del self.tokens[length:]
            if self._indexed > length:
                self._last, self._indexed = {}, 0

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens (empty: no earlier occurrence of any suffix n-gram)."""
        toks = self.tokens
        if k <= 0:
            return []
        if self._indexed < len(toks):
            self._index()
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            j = self._last.get(tuple(toks[len(toks) - n:]))
            if j is not None:
                return toks[j:j + k]
        return []
