"""Benchmark prompts generated locally (nothing is downloaded).

  random           random prompts of --random-input-len tokens (+- --random-range-ratio) and
                   output lengths of --random-output-len (+- the same ratio)
  prefix           --num-prefix-groups shared prefixes of --prefix-len tokens, each request
                   = one group's prefix + a random suffix of --random-input-len tokens
                   (a prefix-cache workload)
  sharegpt-sample  the bundled multi-turn conversations (data/conversations.json): the turns
                   up to the last user turn are the prompt, the reply's length the output length

With a tokenizer (--tokenizer, or --model when it is a local directory) prompt lengths are
exact: random token ids are decoded to text and re-encoded, as `vllm bench` does. Without one,
prompts are random common English words, about one token each."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "prefix", "sharegpt-sample")
CONVERSATIONS = Path(__file__).parent / "data" / "conversations.json"
_WORDS = ("time year people way day man thing woman life child world school state family student "
          "group country problem hand part place case week company system program question work "
          "government number night point home water room mother area money story fact month lot "
          "right study book eye job word business issue side kind head house service friend father "
          "power hour game line end member law car city community name president team minute idea "
          "kid body information back parent face others level office door health person art war "
          "history party result change morning reason research girl guy moment air teacher force "
          "education").split()


@dataclass
class SampleRequest:
    prompt: str | None                  # text (completions) ...
    messages: list[dict] | None         # ... or chat messages (sharegpt-sample)
    prompt_len: int                     # tokens, as counted by our tokenizer (or estimated)
    output_len: int                     # max_tokens to ask for


class Tokenizer:
    """HF `tokenizers` from a model directory or a tokenizer.json file."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise ValueError(f"no tokenizer.json at {path!r}")
        self._tok = HFTokenizer.from_file(str(f))
        self.vocab_size = self._tok.get_vocab_size()
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special} \
            if hasattr(self._tok, "get_added_tokens_decoder") else set()
        self._special_ids = {self._tok.token_to_id(s) for s in special}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def random_text(self, rng: random.Random, n: int) -> tuple[str, int]:
        """Text of exactly n tokens when re-encoded (or as close as the tokenizer allows)."""
        ids = [self._random_id(rng) for _ in range(n)]
        for _ in range(4):  # decode/re-encode can merge or split tokens: adjust and retry
            text = self.decode(ids)
            enc = self.encode(text)
            if len(enc) == n:
                return text, n
            ids = enc[:n] + [self._random_id(rng) for _ in range(n - len(enc))]
        return text, len(enc)

    def _random_id(self, rng: random.Random) -> int:
        while True:
            t = rng.randrange(100, self.vocab_size) if self.vocab_size > 200 else rng.randrange(self.vocab_size)
            if t not in self._special_ids:
                return t


def load_tokenizer(tokenizer: str | None, model: str | None) -> Tokenizer | None:
    path = tokenizer or (model if model and os.path.isdir(model) else None)
    return Tokenizer(path) if path else None


def _words(rng: random.Random, n: int) -> tuple[str, int]:
    return " ".join(rng.choice(_WORDS) for _ in range(n)), n


def _text(tok: Tokenizer | None, rng: random.Random, n: int) -> tuple[str, int]:
    return tok.random_text(rng, n) if tok else _words(rng, n)


def _spread(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    tok: Tokenizer | None) -> list[SampleRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, plen = _text(tok, rng, _spread(rng, input_len, range_ratio))
        out.append(SampleRequest(text, None, plen, _spread(rng, output_len, range_ratio)))
    return out


def prefix_requests(n: int, prefix_len: int, num_groups: int, suffix_len: int, output_len: int,
                    seed: int, tok: Tokenizer | None) -> list[SampleRequest]:
    rng = random.Random(seed)
    prefixes = [_text(tok, rng, prefix_len) for _ in range(num_groups)]
    out = []
    for i in range(n):
        ptext, plen = prefixes[i % num_groups]
        stext, slen = _text(tok, rng, suffix_len)
        out.append(SampleRequest(f"{ptext} {stext}", None, plen + slen, output_len))
    rng.shuffle(out)
    return out


def sharegpt_sample_requests(n: int, output_len: int | None, seed: int, tok: Tokenizer | None,
                             path: Path = CONVERSATIONS) -> list[SampleRequest]:
    convs = json.loads(path.read_text())["conversations"]
    rng = random.Random(seed)
    count = (lambda s: len(tok.encode(s))) if tok else (lambda s: len(s.split()))
    out = []
    for i in range(n):
        turns = convs[(i if i < len(convs) else rng.randrange(len(convs)))]["turns"]
        # the prompt: every turn before the last assistant reply; that reply sets the output length
        last = max(j for j, t in enumerate(turns) if t["role"] == "assistant")
        messages = [{"role": t["role"], "content": t["content"]} for t in turns[:last]]
        plen = sum(count(m["content"]) for m in messages)
        olen = output_len or max(4, count(turns[last]["content"]))
        out.append(SampleRequest(None, messages, plen, olen))
    return out


def messages_as_text(messages: list[dict]) -> str:
    """Flatten a conversation for the completions API."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
