"""Suffix decoding: per request over its prompt and output, plus one shared store of recent
finished outputs (bounded: the oldest goes when a new one pushes it past the cap). A proposal
finds the longest context (up to `depth - 1` tokens) that ends the request's text and occurs
earlier with a continuation, and follows the most frequent continuation token by token, while
the path's estimated probability (the product of each step's count share) stays above
`min_prob`: its length adapts to how predictable the text is, as SuffixDecoding's does.

No index is built: a match is one vectorised scan of an int32 token array for the context's
last token, then one filter per extra context token over the few candidates left; drafting a
token only filters the candidates. A proposal costs tens of microseconds at any context length,
the first one as much as the later ones, and memory is a few bytes a token. (The frequency
tries this replaced cost O(depth) dictionary nodes per token, built at a request's first
proposal: 4.5 ms for a 256-token prompt here, 5 s of host time for 256 of them at 2k tokens.)

The shared store (suffix_cache.py) is indexed instead: its text grows with every finished output
and is read by every request at every step. Its outputs are separated by SENTINEL, which no
context or continuation can match, so no context runs from one output into the next. A request
whose own text gives a full draft from the longest context does not ask it (it could not win)."""
from __future__ import annotations

import numpy as np

SENTINEL = -1


class TokenBuffer:
    """A growing int32 array of token ids (capacity doubles)."""

    __slots__ = ("_arr", "n")

    def __init__(self, tokens=()) -> None:
        self._arr = np.empty(max(64, 2 * len(tokens)), dtype=np.int32)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens) -> None:
        m = len(tokens)
        if not m:
            return
        if self.n + m > len(self._arr):
            grown = np.empty(max(2 * len(self._arr), self.n + m), dtype=np.int32)
            grown[:self.n] = self._arr[:self.n]
            self._arr = grown
        self._arr[self.n:self.n + m] = tokens
        self.n += m

    def view(self) -> np.ndarray:
        return self._arr[:self.n]



def longest_match(arr: np.ndarray, toks: list[int], ctx: list[int], max_len: int) -> tuple[list[int], int]:
    """The ends of the occurrences in the text (`arr` and `toks`: the same tokens as an array
    and a list) of the longest suffix of `ctx` (at most max_len tokens) that occurs with a
    continuation, and that suffix's length; ([], 0) if none."""
    if not ctx or max_len <= 0 or len(toks) < 2:
        return [], 0
    # One vectorised scan for the last token; the few candidates left are filtered in Python.
    ends = [p for p in np.flatnonzero(arr[:-1] == ctx[-1]).tolist() if toks[p + 1] != SENTINEL]
    if not ends:
        return [], 0
    return extend_match(toks, ctx, ends, 1, min(max_len, len(ctx)))


def extend_match(toks: list[int], ctx: list[int], ends: list[int], d: int, limit: int) -> tuple[list[int], int]:
    """The ends of the occurrences of ctx's last d tokens in `toks`, narrowed to the longest
    suffix of ctx (at most `limit` tokens) that still occurs, and that suffix's length.
    Occurrences of a longer suffix are a subset of a shorter one's (same ends)."""
    while d < limit:
        c = ctx[-1 - d]
        longer = [p for p in ends if p >= d and toks[p - d] == c]
        if not longer:
            break
        ends, d = longer, d + 1
    return ends, d


def _most_frequent(conts: list[int]) -> tuple[int, int]:
    """The most frequent token of conts and its count (ties: the one that occurs first)."""
    counts: dict[int, int] = {}
    for t in conts:
        counts[t] = counts.get(t, 0) + 1
    token = max(counts, key=counts.__getitem__)    # max keeps the first of equal counts
    return token, counts[token]


def propose(arr: np.ndarray, toks: list[int], context: list[int], k: int, depth: int,
            min_prob: float) -> tuple[list[int], int]:
    """Up to k tokens continuing `context`, from the occurrences in the text (`arr`, `toks`),
    and the length of the context match they start from."""
    return walk(lambda ctx, max_len: longest_match(arr, toks, ctx, max_len), toks, context, k, depth, min_prob)


def walk(match, toks: list[int], context: list[int], k: int, depth: int,
         min_prob: float) -> tuple[list[int], int]:
    """The draft from a text `toks` whose context matches `match(ctx, max_len)` finds (as
    longest_match does). The matched context grows with every token drafted (the occurrences
    followed are those of the context plus the draft so far, as a walk down a suffix tree); only
    when none of them continues is the context matched again."""
    out: list[int] = []
    ctx = list(context[-(depth - 1):]) if depth > 1 else []
    prob, matched, n = 1.0, 0, len(toks)
    ends: list[int] = []
    while len(out) < k:
        if not ends:
            ends, d = match(ctx, depth - 1)
            if not ends:
                break
            if not out:
                matched = d
        if len(ends) == 1:
            # One occurrence (a passage copied once): its continuation up to the end of its text,
            # with the probability unchanged, as token-by-token steps would take it.
            p = ends[0]
            seg = toks[p + 1:p + 1 + k - len(out)]
            if SENTINEL in seg:
                seg = seg[:seg.index(SENTINEL)]
            out.extend(seg)
            ctx = (ctx + seg)[-(depth - 1):] if depth > 1 else []
            ends = []           # the draft is full, or this text ended: match the context again
            continue
        conts = [toks[p + 1] for p in ends]
        token, count = _most_frequent(conts)
        prob *= count / len(conts)
        if prob < min_prob:
            break
        out.append(token)
        ctx.append(token)
        if len(ctx) > depth - 1:
            del ctx[0]
        ends = [p + 1 for p, c in zip(ends, conts) if c == token and p + 2 < n and toks[p + 2] != SENTINEL]
    return out, matched


class SuffixProposer:
    """One request: its own text (prompt + outputs) and the shared cache of recent outputs."""

    __slots__ = ("depth", "cache", "min_prob", "tokens", "_arr", "num_prompt")

    def __init__(self, depth: int, min_prob: float, cache, prompt: list[int]) -> None:
        """cache: the shared store of recent outputs (suffix_cache.SuffixCache) or None."""
        self.depth = depth
        self.cache, self.min_prob = cache, min_prob
        self.tokens: list[int] = list(prompt)    # the list for the candidates' lookups,
        self._arr = TokenBuffer(prompt)           # the array for the scans
        self.num_prompt = len(prompt)

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        self._arr.extend(new_tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        context = self.tokens[-(self.depth - 1):] if self.depth > 1 else []
        own, own_depth = propose(self._arr.view(), self.tokens, context, k, self.depth, self.min_prob)
        if self.cache is None or len(self.cache) == 0 or (own_depth == len(context) and len(own) == k):
            return own      # (the shared store cannot beat a full draft from the longest context)
        shared, shared_depth = self.cache.propose(context, k, self.min_prob)
        # The longer context match is the better evidence; on a tie, the longer draft.
        if (shared_depth, len(shared)) > (own_depth, len(own)):
            return shared
        return own

    def finish(self) -> None:
        """The request ended: its output joins the shared cache."""
        if self.cache is not None:
            self.cache.add_output(self.tokens[self.num_prompt:])
