"""The embedding engine: the model's tokenizer and encoder, no I/O.

`prepare()` turns wire items (texts or token ids) into validated token-id lists;
`embed()` runs any number of them as a few padded forward passes. Items are grouped by
length so short texts are not padded to the longest one of a big batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch

from services.embedder.bert import BertConfigError, load_bert


class InvalidInput(ValueError):
    """A request the engine refuses (the caller answers INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Item:
    """One input: its text, or its token ids (exactly one is set)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None


class EmbeddingEngine:
    def __init__(self, model_dir: str | Path, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, max_model_len: int = 0,
                 max_batch_tokens: int = 8192) -> None:
        model_dir = Path(model_dir)
        self.model = load_bert(model_dir, device, dtype)
        cfg = self.model.cfg
        if max_model_len > cfg.max_position_embeddings:
            raise BertConfigError(f"max_model_len {max_model_len} exceeds the model's "
                                  f"max_position_embeddings {cfg.max_position_embeddings}")
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_batch_tokens = max_batch_tokens   # a longer item still runs, alone
        self.dimensions = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        try:
            tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise BertConfigError(f"cannot load {model_dir}/tokenizer.json: {exc}") from exc
        # tokenizer.json of MiniLM pads and truncates to 128: that would silently cut long
        # inputs. Length limits are ours to enforce, with a clear error.
        tok.no_truncation()
        tok.no_padding()
        self.tokenizer = tok
        pad = tok.token_to_id("[PAD]")
        self.pad_id = 0 if pad is None else pad

    # --- validation --------------------------------------------------------------------

    def prepare(self, items: Sequence[Item], truncate: int | None = None) -> list[list[int]]:
        """Token ids of each item, validated against the vocabulary and max_model_len.

        truncate: None refuses items longer than max_model_len; k >= 1 keeps the first k
        tokens (texts keep their final [SEP]); -1 means k = max_model_len."""
        if truncate is not None:
            if truncate == -1:
                truncate = self.max_model_len
            if not 1 <= truncate <= self.max_model_len:
                raise InvalidInput(f"truncate_prompt_tokens must be -1 or in [1, "
                                   f"{self.max_model_len}], got {truncate}")
        texts = [(i, it.text) for i, it in enumerate(items) if it.text is not None]
        encoded = dict(zip((i for i, _ in texts), self.tokenizer.encode_batch(
            [t for _, t in texts], add_special_tokens=True))) if texts else {}
        out = []
        for i, item in enumerate(items):
            if item.text is not None:
                if not item.text:
                    raise InvalidInput(f"input[{i}] is an empty string")
                ids = encoded[i].ids
                if truncate is not None and len(ids) > truncate >= 2:
                    ids = ids[:truncate - 1] + ids[-1:]   # [CLS] ... [SEP], like HF truncation
            else:
                ids = list(item.token_ids or ())
                if not ids:
                    raise InvalidInput(f"input[{i}] has no token ids")
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise InvalidInput(f"input[{i}] has token id {bad}, outside the "
                                       f"vocabulary [0, {self.vocab_size})")
            if truncate is not None:
                ids = ids[:truncate]
            elif len(ids) > self.max_model_len:
                raise InvalidInput(f"input[{i}] has {len(ids)} tokens, more than the model's "
                                   f"maximum context length of {self.max_model_len}; shorten "
                                   "it or set truncate_prompt_tokens")
            out.append(ids)
        return out

    # --- the forward passes ----------------------------------------------------------------

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """Token-id lists (each 1..max_model_len long) -> float32 [len(batch), dimensions]."""
        out = np.empty((len(batch), self.dimensions), dtype=np.float32)
        # Longest first, cut into chunks whose padded size fits the token budget.
        order = sorted(range(len(batch)), key=lambda i: -len(batch[i]))
        start = 0
        while start < len(order):
            width = len(batch[order[start]])
            rows = max(1, self.max_batch_tokens // width)
            chunk = order[start:start + rows]
            out[chunk] = self._forward([batch[i] for i in chunk], width)
            start += len(chunk)
        return out

    def _forward(self, seqs: list[Sequence[int]], width: int) -> np.ndarray:
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        for row, seq in enumerate(seqs):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = True
        device = self.model.device
        vectors = self.model.embed(ids.to(device), mask.to(device))   # [B, H] float32
        return vectors.cpu().numpy()
