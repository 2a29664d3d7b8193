"""Build tokenizer.json and tokenizer_config.json from a GGUF file's tokenizer metadata.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported: that is
what SmolLM2, Llama 3 and Qwen2 ship. The pre-tokenizer is chosen by `tokenizer.ggml.pre`,
which names the split llama.cpp applies before BPE; we rebuild the HF equivalent of it
(transformers' own GGUF loader falls back to plain GPT-2 splitting for "smollm", which
differs from SmolLM2's real tokenizer on runs of spaces before a digit, e.g. "a  1").
"""
from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .gguf_fields import field_value

# llama.cpp token types (llama_token_type in llama.h).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """HF pre-tokenizer equal to llama.cpp's split for `tokenizer.ggml.pre`."""
    if pre == "smollm":
        # llama.cpp: "\p{N}" then the GPT-2 regex; SmolLM2's own tokenizer.json says the same
        # as Digits(individual_digits) + ByteLevel(use_regex).
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return _byte_level()
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), _byte_level(False)])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE tokens."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _spell_byte_level(token: str) -> str:
    # A vocabulary token is normally already spelled in the byte alphabet; a few GGUF writers
    # store raw text instead, which BPE would never produce, so re-spell it.
    alphabet = set(bytes_to_unicode().values())
    if set(token) <= alphabet:
        return token
    table = bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


def _post_processor(add_bos: bool, add_eos: bool, bos: str | None, eos: str | None,
                    token_ids: dict[str, int]) -> processors.PostProcessor:
    if not add_bos and not add_eos:
        # What SmolLM2's own tokenizer.json uses: only fixes offsets, adds no tokens.
        return processors.ByteLevel(trim_offsets=False)
    prefix = [bos] if add_bos and bos else []
    suffix = [eos] if add_eos and eos else []
    single = " ".join([*(f"{t}:0" for t in prefix), "$A:0", *(f"{t}:0" for t in suffix)])
    pair = single + " " + " ".join([*(f"{t}:1" for t in prefix), "$B:1", *(f"{t}:1" for t in suffix)])
    specials = sorted({(t, token_ids[t]) for t in prefix + suffix})
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_tokenizer(reader) -> Tokenizer:
    model = field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE)")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges: list[str] = field_value(reader, "tokenizer.ggml.merges") or []

    added = {TOKEN_CONTROL, TOKEN_USER_DEFINED}
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        vocab[token if kind in added else _spell_byte_level(token)] = token_id
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("GGUF merges must be 'left right' pairs")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole and skipped when decoding with
    # skip_special_tokens; user-defined ones (<think>) are matched whole but are text.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])

    bos, eos = _special(reader, tokens, "bos_token_id"), _special(reader, tokens, "eos_token_id")
    tokenizer.post_processor = _post_processor(
        bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)), bos, eos, vocab)
    return tokenizer


def _special(reader, tokens: list[str], key: str) -> str | None:
    token_id = field_value(reader, f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise ValueError(f"tokenizer.ggml.{key} {token_id} is outside the vocabulary")
    return tokens[int(token_id)]


def build_tokenizer_config(reader, model_max_length: int) -> dict:
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token = _special(reader, tokens, key)
        if token is not None:
            config[name] = token
    template = field_value(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def build_tokenizer_files(reader, model_max_length: int) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) for the GGUF behind `reader`."""
    tokenizer = build_tokenizer(reader)
    return tokenizer.to_str(pretty=True), build_tokenizer_config(reader, model_max_length)
