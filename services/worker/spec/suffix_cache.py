"""Suffix decoding's shared store: the recent finished outputs of every request (at most
`max_outputs`; the oldest goes when a new one pushes it past the cap), indexed so that a proposal
costs the same at any size of the store.

The text is one list of tokens, each output followed by SENTINEL (no context or continuation runs
from one output into the next). Two maps index it by absolute position (positions are never
reused, so evicting an output touches no map): each token to the positions where it occurs with a
continuation, and each run of ANCHOR tokens to the positions where it ends. A context match starts
from the longest of the two keys the context has, among its most recent `max_occurrences`
occurrences, and grows one token at a time over those candidates, as the request's own text does
(suffix.longest_match); the walk is suffix.walk. Evicted outputs stay in the list (and their
positions in the maps, skipped by a bisection) until they are half of it; then both are rebuilt
from the kept outputs, so the rebuilding costs O(1) per token stored.

With fewer than max_occurrences occurrences of every key, a proposal equals the exhaustive search
over the kept outputs (tests/unit/test_spec_proposers.py); past it, the continuation counts are
those of the most recent occurrences."""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque

from services.worker.spec.suffix import SENTINEL, extend_match, walk

ANCHOR = 3                # the longer index key: the last ANCHOR tokens of a context
MAX_OCCURRENCES = 64      # occurrences of a context followed at once (the most recent)


class SuffixCache:
    def __init__(self, depth: int, max_outputs: int, max_occurrences: int = MAX_OCCURRENCES) -> None:
        self.depth = depth
        self.max_outputs = max_outputs
        self.max_occurrences = max(1, max_occurrences)
        self._toks: list[int] = []            # the stored text, from absolute position _base
        self._base = 0
        self._live = 0                        # where the oldest kept output starts (absolute)
        self._outputs: deque[int] = deque()   # each kept output's length, its SENTINEL included
        self._by_token: dict[int, array] = {}
        self._by_run: dict[tuple[int, ...], array] = {}

    def __len__(self) -> int:
        return len(self._outputs)

    def add_output(self, tokens) -> None:
        if self.max_outputs <= 0 or not len(tokens):
            return
        toks = [int(t) for t in tokens]
        start = self._base + len(self._toks)
        self._toks.extend(toks)
        self._toks.append(SENTINEL)
        self._outputs.append(len(toks) + 1)
        self._index(toks, start)
        while len(self._outputs) > self.max_outputs:
            self._live += self._outputs.popleft()
        if 2 * (self._live - self._base) > len(self._toks):
            self._compact()

    def _index(self, toks: list[int], start: int) -> None:
        """Positions of one output (at absolute `start`) that have a continuation in it."""
        by_token, by_run = self._by_token, self._by_run
        for i in range(len(toks) - 1):
            p = start + i
            a = by_token.get(toks[i])
            if a is None:
                a = by_token[toks[i]] = array("q")
            a.append(p)
            if i >= ANCHOR - 1:
                key = tuple(toks[i - ANCHOR + 1:i + 1])
                a = by_run.get(key)
                if a is None:
                    a = by_run[key] = array("q")
                a.append(p)

    def _compact(self) -> None:
        """Drop the evicted outputs' tokens and index entries (rebuilt from the kept outputs)."""
        self._toks = self._toks[self._live - self._base:]
        self._base = self._live
        self._by_token, self._by_run = {}, {}
        start = self._base
        for n in self._outputs:
            self._index(self._toks[start - self._base:start - self._base + n - 1], start)
            start += n

    def _recent(self, positions: array | None) -> list[int]:
        """The most recent max_occurrences kept positions of an index entry (ascending)."""
        if positions is None:
            return []
        lo = max(bisect_left(positions, self._live), len(positions) - self.max_occurrences)
        return positions[lo:].tolist()

    def _match(self, ctx: list[int], max_len: int) -> tuple[list[int], int]:
        """suffix.longest_match over the store: the (relative) ends of the longest suffix of ctx
        (at most max_len tokens) that occurs with a continuation, and its length."""
        if not ctx or max_len <= 0 or not self._outputs:
            return [], 0
        toks, base = self._toks, self._base
        limit = min(max_len, len(ctx))
        ends, d = [], 0
        if limit >= ANCHOR:
            ends = self._recent(self._by_run.get(tuple(ctx[-ANCHOR:])))
            d = ANCHOR
        if not ends:
            ends, d = self._recent(self._by_token.get(ctx[-1])), 1
            if not ends:
                return [], 0
        return extend_match(toks, ctx, [p - base for p in ends], d, limit)

    def propose(self, context: list[int], k: int, min_prob: float) -> tuple[list[int], int]:
        """Up to k tokens continuing context from the stored outputs, and the context match's length."""
        if not self._outputs:
            return [], 0
        return walk(self._match, self._toks, context, k, self.depth, min_prob)
