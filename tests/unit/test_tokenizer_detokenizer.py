"""Incremental detokenization: deltas add up to the full decode, split characters are
held back, the first output token keeps its space, per-request state is bounded."""
import random

import pytest

from services.tokenizer.detokenizer import (MAX_HELD_TOKENS, DetokenizerFullError,
                                            IncrementalDetokenizer, decode_step, new_state)
from services.tokenizer.testing import build_byte_level_bpe, build_sentencepiece_like_bpe

ALPHABET = "ab xyz.,\n éüß 日本語 😀🎉👍🏽 <|im_end|>"


@pytest.fixture(scope="module")
def bpe():
    return build_byte_level_bpe()


def _decoder(tok):
    return lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)


def _stream(detok, request_id, ids, rng, *, skip, prefix=()):
    """Feed `ids` in random chunks of 1-4 tokens, then finish; returns every delta."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        deltas.append(detok.step(request_id, ids[i:i + n], prefix_token_ids=prefix if i == 0 else (),
                                 skip_special_tokens=skip))
        i += n
    deltas.append(detok.step(request_id, [], finished=True))
    return deltas


@pytest.mark.parametrize("skip", [False, True])
def test_concatenated_deltas_equal_full_decode_for_random_multibyte_texts(bpe, skip):
    rng = random.Random(1234)
    detok = IncrementalDetokenizer(_decoder(bpe))
    for trial in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 50)))
        ids = bpe.encode(text).ids
        deltas = _stream(detok, f"r{trial}", ids, rng, skip=skip)
        assert "".join(deltas) == bpe.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas), "a split character leaked out"
    assert len(detok) == 0


def test_concatenated_deltas_equal_full_decode_for_random_token_ids(bpe):
    rng = random.Random(99)
    detok = IncrementalDetokenizer(_decoder(bpe))
    vocab = bpe.get_vocab_size()
    for trial in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        skip = trial % 2 == 0
        assert "".join(_stream(detok, "r", ids, rng, skip=skip)) == bpe.decode(ids, skip_special_tokens=skip)


def test_emoji_split_across_tokens_is_held_back_until_complete(bpe):
    ids = bpe.encode("ok 😀").ids
    pieces = [bpe.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "test needs an emoji split over tokens"
    detok = IncrementalDetokenizer(_decoder(bpe))
    deltas = [detok.step("r", [i]) for i in ids]
    assert "".join(deltas) == "ok 😀"
    assert deltas[-1].endswith("😀")
    assert all("\ufffd" not in d for d in deltas)


def test_finished_flushes_bytes_that_never_complete(bpe):
    ids = bpe.encode("hi 😀").ids[:-1]          # drop the emoji's last byte(s)
    detok = IncrementalDetokenizer(_decoder(bpe))
    held = [detok.step("r", [i]) for i in ids]
    assert "".join(held) == "hi"
    flushed = detok.step("r", [], finished=True)
    assert "hi" + flushed == bpe.decode(ids)
    assert flushed.endswith("\ufffd")
    assert "r" not in detok


def test_prefix_context_keeps_the_first_output_tokens_leading_space():
    sp = build_sentencepiece_like_bpe()
    prompt, output = sp.encode("The quick").ids, sp.encode("brown fox").ids
    decode = _decoder(sp)
    assert sp.decode(output[:1]) == "brown", "SentencePiece-style decode strips the first space"
    with_context = IncrementalDetokenizer(decode)
    text = "".join(with_context.step("r", [i], prefix_token_ids=prompt if n == 0 else ())
                   for n, i in enumerate(output)) + with_context.step("r", [], finished=True)
    assert text == " brown fox"
    without_context = IncrementalDetokenizer(decode)
    assert without_context.step("r", output) == "brown fox"


def test_skip_special_tokens_drops_them_from_the_deltas(bpe):
    eos = bpe.token_to_id("<|im_end|>")
    ids = bpe.encode("Hello world").ids + [eos]
    keep, skip = IncrementalDetokenizer(_decoder(bpe)), IncrementalDetokenizer(_decoder(bpe))
    assert keep.step("a", ids, skip_special_tokens=False) == "Hello world<|im_end|>"
    assert skip.step("a", ids, skip_special_tokens=True) == "Hello world"


def test_decode_window_stays_small_over_a_long_output(bpe):
    decode = _decoder(bpe)
    state = new_state(decode, [], skip_special_tokens=False)
    ids = bpe.encode("The quick brown fox jumps over the lazy dog. " * 40).ids
    text = "".join(decode_step(decode, state, [i]) for i in ids)
    assert text == bpe.decode(ids)
    assert len(state.ids) <= 2 * MAX_HELD_TOKENS


def test_new_requests_are_refused_when_the_state_map_is_full(bpe):
    detok = IncrementalDetokenizer(_decoder(bpe), max_requests=2)
    detok.step("a", [10])
    detok.step("b", [11])
    with pytest.raises(DetokenizerFullError):
        detok.step("c", [12])
    detok.step("a", [13])                    # known requests keep working when full
    detok.step("a", [], finished=True)
    assert len(detok) == 1
    detok.step("c", [12])                    # room again after a finish
    assert len(detok) == 2


def test_single_item_request_that_finishes_at_once_keeps_no_state(bpe):
    detok = IncrementalDetokenizer(_decoder(bpe), max_requests=1)
    detok.step("busy", [5])
    ids = bpe.encode("done").ids
    assert detok.step("once", ids, finished=True) == "done"   # no slot needed
    assert "once" not in detok and len(detok) == 1
