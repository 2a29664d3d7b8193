"""Speculative decoding's proposers (services/worker/spec): n-gram prompt lookup and suffix
decoding, against brute-force references on random and repetitive token streams."""
from __future__ import annotations

import random

import numpy as np
import pytest

from services.worker.spec.ngram import NgramProposer
from services.worker.spec.suffix import SENTINEL, SuffixProposer, propose
from services.worker.spec.suffix_cache import SuffixCache


def brute_ngram(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        pattern = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):     # the most recent earlier occurrence
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_ngram_proposals_equal_a_brute_force_search_as_tokens_arrive(seed):
    rng = random.Random(seed)
    stream = [rng.randrange(6) for _ in range(300)]          # a small alphabet: many repeats
    prop = NgramProposer(2, 4, stream[:5])
    for i in range(5, len(stream)):
        assert prop.propose(3) == brute_ngram(stream[:i], 2, 4, 3), i
        prop.extend([stream[i]])


def test_ngram_proposes_the_continuation_of_a_repeated_passage():
    passage = list(range(100, 140))
    prop = NgramProposer(2, 5, [1, 2, 3] + passage + [7, 8] + passage[:10])
    assert prop.propose(5) == passage[10:15]
    assert NgramProposer(2, 5, [1, 2, 3, 4]).propose(5) == []    # nothing repeats
    prop.truncate(3 + 40)
    assert prop.tokens == [1, 2, 3] + passage and prop.propose(4) == brute_ngram(prop.tokens, 2, 5, 4)


def brute_suffix(seqs: list[list[int]], context: list[int], k: int, depth: int,
                 min_prob: float) -> tuple[list[int], int]:
    """Suffix decoding's proposal by exhaustive search: the continuation counts of a context are
    counted over every occurrence in every sequence (in order: ties go to the first seen)."""
    def conts(c: tuple[int, ...]) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in seqs:
            for p in range(len(c) - 1, len(s) - 1):
                if tuple(s[p - len(c) + 1:p + 1]) == c:
                    out[s[p + 1]] = out.get(s[p + 1], 0) + 1
        return out
    ctx = list(context[-(depth - 1):]) if depth > 1 else []
    out: list[int] = []
    prob, matched, cur = 1.0, 0, None
    while len(out) < k:
        if cur is None:
            for d in range(len(ctx), 0, -1):
                if conts(tuple(ctx[len(ctx) - d:])):
                    cur = tuple(ctx[len(ctx) - d:])
                    matched = matched if out else d
                    break
            else:
                break
        counts = conts(cur)
        token = max(counts, key=counts.__getitem__)
        prob *= counts[token] / sum(counts.values())
        if prob < min_prob:
            break
        out.append(token)
        ctx = (ctx + [token])[-(depth - 1):]
        cur = cur + (token,)        # the walk goes on down the longer context
        if not conts(cur):
            cur = None
    return out, matched


def joined(seqs: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    toks = [t for s in seqs for t in s + [SENTINEL]]
    return np.array(toks, dtype=np.int32), toks


@pytest.mark.parametrize("seed", range(6))
def test_suffix_proposals_equal_an_exhaustive_search(seed):
    rng = random.Random(seed)
    for _ in range(40):
        # A small alphabet (many occurrences) or a larger one (single occurrences: copied text).
        vocab = rng.choice([4, 4, 12])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(rng.randrange(1, 4))]
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        depth, k, min_prob = rng.choice([1, 2, 4, 8]), rng.randrange(1, 9), rng.choice([0.0, 0.1, 0.4, 0.9])
        assert propose(*joined(seqs), context, k, depth, min_prob) == brute_suffix(seqs, context, k, depth, min_prob)


def test_a_request_text_proposal_equals_the_exhaustive_search_as_tokens_arrive():
    rng = random.Random(7)
    stream = [rng.randrange(6) for _ in range(200)]
    prop = SuffixProposer(5, 0.1, None, stream[:3])
    for i in range(3, len(stream)):
        assert prop.propose(4) == brute_suffix([stream[:i]], stream[:i], 4, 5, 0.1)[0], i
        prop.extend([stream[i]])
    assert prop.tokens == stream


def test_suffix_proposals_follow_the_most_frequent_continuation_and_stop_when_unlikely():
    text = joined([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]])
    draft, matched = propose(*text, [7, 1, 2], 4, 4, min_prob=0.1)
    assert draft == [3, 4, 5, 6] and matched == 2
    draft, _ = propose(*text, [7, 1, 2], 4, 4, min_prob=0.9)   # 3 is certain; 4 only 2 times in 3
    assert draft == [3]
    assert propose(*joined([[1, 2], [3, 4]]), [2], 3, 4, 0.0) == ([], 0), "no context runs into the next output"


@pytest.mark.parametrize("seed", range(4))
def test_the_shared_store_proposes_as_an_exhaustive_search_over_its_kept_outputs(seed):
    """Outputs arrive and the oldest are evicted (past the cap, and through the index rebuilds
    that drop them); every proposal equals the exhaustive search over the outputs kept."""
    rng = random.Random(100 + seed)
    cap = rng.choice([1, 3, 5])
    cache, kept = SuffixCache(rng.choice([2, 4, 8]), max_outputs=cap, max_occurrences=10_000), []
    for _ in range(30):
        out = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        cache.add_output(out)
        kept = (kept + [out])[-cap:]
        assert len(cache) == len(kept)
        for _ in range(5):
            context = [rng.randrange(4) for _ in range(rng.randrange(0, 9))]
            k, min_prob = rng.randrange(1, 9), rng.choice([0.0, 0.1, 0.4])
            assert cache.propose(context, k, min_prob) == brute_suffix(kept, context, k, cache.depth, min_prob)


def test_the_shared_store_follows_only_the_most_recent_occurrences_of_a_context():
    cache = SuffixCache(4, max_outputs=100, max_occurrences=3)
    for _ in range(5):
        cache.add_output([1, 2, 3, 7])          # older: 1 2 3 -> 7, five times
    for _ in range(3):
        cache.add_output([1, 2, 3, 8])          # the three most recent: 1 2 3 -> 8
    assert cache.propose([1, 2, 3], 1, 0.0) == ([8], 3)
    assert SuffixCache(4, 100).propose([1, 2, 3], 1, 0.0) == ([], 0)


def test_a_request_with_a_full_draft_from_its_own_text_does_not_read_the_shared_store():
    cache = SuffixCache(4, max_outputs=4)
    cache.add_output([5, 6, 7, 40, 41, 42, 43])
    cache.add_output([5, 6, 7, 40, 41, 42, 43])
    prop = SuffixProposer(4, 0.0, cache, [9, 5, 6, 7, 30, 31, 32, 33, 0, 5, 6, 7])
    assert prop.propose(4) == [30, 31, 32, 33], "own text: the same context, a full draft"
    # An own match shorter than the context (only its last token, 7) asks the store, whose deeper match wins.
    shallow = SuffixProposer(4, 0.0, cache, [8, 7, 30, 31, 32, 33, 5, 6, 7])
    assert shallow.propose(4) == [40, 41, 42, 43]


def test_suffix_proposer_uses_its_own_text_and_the_shared_cache_of_recent_outputs():
    cache = SuffixCache(6, max_outputs=2)
    done = SuffixProposer(6, 0.1, cache, [50, 51])
    done.extend([10, 11, 12, 13, 14, 15])
    done.finish()
    assert len(cache) == 1
    fresh = SuffixProposer(6, 0.1, cache, [99, 10, 11])        # its own text has no 10 11 -> ...
    assert fresh.propose(3) == [12, 13, 14], "from the shared cache"
    own = SuffixProposer(6, 0.1, cache, [1, 2, 3, 4, 1, 2])
    assert own.propose(2) == [3, 4], "from its own prompt"
    for i in range(3):                                          # the cap pushes the first output out
        p = SuffixProposer(6, 0.1, cache, [])
        p.extend([200 + i, 201 + i])
        p.finish()
    assert len(cache) == 2 and SuffixProposer(6, 0.1, cache, [99, 10, 11]).propose(3) == []
