"""Tiny tokenizer model dirs for tests (ours and other services'): built in milliseconds,
no downloads. Byte-level BPE like GPT-2 / SmolLM2 / Qwen, so every string is encodable."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2

# SmolLM2-Instruct's template (ChatML with a default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

TRAINING_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Tokenizers turn text into token ids and back again.",
    "Café, naïve, façade, jalapeño, über, smörgåsbord.",
    "日本語のテキストと中文文本。",
    "Emoji: 😀 🎉 👍🏽 🚀 — and a dash.",
    "def main():\n    return 0\n",
]


def build_byte_level_bpe(vocab_size: int = 400) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE trained on a few sentences (deterministic)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAINING_TEXTS * 3, trainer)
    return tok


def build_sentencepiece_like_bpe(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A Llama-2 style BPE ("▁" for spaces, prepended to the first word and stripped by
    the decoder), to test that the first output token keeps its leading space."""
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                 split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size + 256,
                                  special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(TRAINING_TEXTS * 3, trainer)
    return tok


def write_tiny_tokenizer_dir(path: str | Path, *, chat_template: str | None = CHATML_TEMPLATE,
                             add_bos_token: bool | None = None,
                             eos_token_id: int | list[int] = (2, 0),
                             max_position_embeddings: int = 2048) -> Path:
    """Write tokenizer.json, tokenizer_config.json, generation_config.json and config.json
    for the byte-level BPE above into `path`; returns `path`."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    build_byte_level_bpe().save(str(root / "tokenizer.json"))
    tok_cfg: dict = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                     "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>",
                     "model_max_length": 2048}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    if add_bos_token is not None:
        tok_cfg["add_bos_token"] = add_bos_token
    eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    _write_json(root / "tokenizer_config.json", tok_cfg)
    _write_json(root / "generation_config.json", {"bos_token_id": 1, "eos_token_id": eos})
    _write_json(root / "config.json", {"model_type": "llama", "vocab_size": 400,
                                       "max_position_embeddings": max_position_embeddings})
    return root


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
