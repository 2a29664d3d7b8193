"""Speculative decoding's proposers (services/worker/spec): n-gram prompt lookup and suffix
decoding, against brute-force references on random and repetitive token streams."""
from __future__ import annotations

import random

import pytest

from services.worker.spec.ngram import NgramProposer
from services.worker.spec.suffix import SuffixCache, SuffixProposer, SuffixTrie


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


def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1
    return counts


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}

    def walk(node, path):
        for t, child in (node[1] or {}).items():
            out[path + (t,)] = child[0]
            walk(child, path + (t,))
    walk(trie.root, ())
    return out


def test_the_suffix_trie_counts_every_context_and_removal_takes_them_back():
    rng = random.Random(1)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    trie = SuffixTrie(4)
    for s in seqs:
        trie.start_sequence()
        trie.extend(s)
    assert trie_counts(trie) == brute_counts(seqs, 4)
    for s in seqs[:3]:
        trie.remove_sequence(s)
    assert trie_counts(trie) == brute_counts(seqs[3:], 4), "removed sequences leave no count and no node"


def test_suffix_proposals_follow_the_most_frequent_continuation_and_stop_when_unlikely():
    trie = SuffixTrie(4)
    for s in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]):
        trie.start_sequence()
        trie.extend(s)
    draft, matched = trie.propose([7, 1, 2], 4, min_prob=0.1)
    assert draft == [3, 4, 5, 6] and matched == 2
    draft, _ = trie.propose([7, 1, 2], 4, min_prob=0.9)   # 3 is certain; 4 only 2 times in 3
    assert draft == [3]


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
