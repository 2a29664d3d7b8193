"""N-gram prompt lookup: the proposal for a request is what followed the most recent earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min), up to k
tokens. Incremental: each appended token adds one entry per n to a map from n-gram to the index
right after its latest occurrence, so a proposal costs O(max - min) lookups, never a scan of the
whole context (a scan of an 8k-token context for every request of every step would cost more
than the step).

The map only holds n-grams that already have a continuation (the n-gram ending at the previous
token, mapped to the index of the newest one), so the request's current suffix never matches
itself."""
from __future__ import annotations


class NgramProposer:
    """One request's n-gram index over its tokens (prompt + outputs)."""

    __slots__ = ("n_min", "n_max", "tokens", "_last")

    def __init__(self, n_min: int, n_max: int, tokens: list[int] | None = None) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens or [])

    def extend(self, new_tokens: list[int]) -> None:
        toks = self.tokens
        for t in new_tokens:
            j = len(toks)          # index of t: the continuation of every n-gram ending at j - 1
            for n in range(self.n_min, self.n_max + 1):
                if j >= n:
                    self._last[tuple(toks[j - n:j])] = j
            toks.append(t)

    def truncate(self, length: int) -> None:
        """Forget tokens past `length` (rejected drafts appended by mistake; a rare path: rebuilds)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._last = [], {}
            self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens (empty: no earlier occurrence of any suffix n-gram)."""
        toks = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            j = self._last.get(tuple(toks[len(toks) - n:]))
            if j is not None:
                return toks[j:j + k]
        return []
