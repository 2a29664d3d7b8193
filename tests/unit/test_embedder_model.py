"""Our BERT encoder and embedding engine against transformers on the real all-MiniLM-L6-v2
weights (22M parameters: fast on a CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.embedder.bert import BertConfig, load_bert
from services.embedder.engine import EmbeddingEngine, InvalidInput, Item

TEXTS = [
    "A man is eating food.",
    "hello",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "naïve café, 日本語, emoji 🤖 and numbers 3.14159",
    "Embeddings map text to vectors so similar meanings land close together.",
]


@pytest.fixture(scope="module")
def one_thread():
    # Tiny matmuls: OpenMP threads waiting on each other on a busy 2-core machine only slow them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(minilm_dir, one_thread):
    """sentence-transformers' recipe with transformers: mean pooling over real tokens, L2 norm."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()

    def embed(texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
        batch = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        ids = [row[:n].tolist() for row, n in zip(batch["input_ids"], batch["attention_mask"].sum(1))]
        return torch.nn.functional.normalize(pooled, dim=1).numpy(), ids

    return embed, tok


@pytest.fixture(scope="module")
def engine(minilm_dir, one_thread):
    return EmbeddingEngine(minilm_dir)


def test_config_follows_the_sentence_transformers_modules(minilm_dir):
    cfg = BertConfig.from_dir(minilm_dir)
    assert (cfg.pooling, cfg.normalize) == ("mean", True)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.max_position_embeddings) == (384, 6, 12, 512)


def test_encoder_hidden_states_equal_transformers(minilm_dir, reference, one_thread):
    from transformers import AutoModel

    _, tok = reference
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    ours = load_bert(minilm_dir).hidden_states(batch["input_ids"], batch["attention_mask"].bool())
    with torch.no_grad():
        theirs = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-4)


def test_engine_embeddings_match_transformers_mean_pooled_and_normalised(engine, reference):
    expected, expected_ids = reference[0](TEXTS)
    ids = engine.prepare([Item(text=t) for t in TEXTS])
    assert ids == expected_ids  # same tokenizer, [CLS] ... [SEP]
    got = engine.embed(ids)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    cosine = (got * expected).sum(1)
    assert cosine.min() >= 0.9999, cosine
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_batched_vectors_equal_solo_vectors(engine):
    ids = engine.prepare([Item(text=t) for t in TEXTS])
    batched = engine.embed(ids)
    solo = np.concatenate([engine.embed([seq]) for seq in ids])
    assert np.allclose(batched, solo, atol=1e-5)


def test_a_batch_larger_than_the_token_budget_is_split_and_keeps_its_order(minilm_dir, engine):
    small = EmbeddingEngine(minilm_dir, max_batch_tokens=16)   # one item per forward pass
    ids = engine.prepare([Item(text=t) for t in TEXTS[:3]])
    assert np.allclose(small.embed(ids), engine.embed(ids), atol=1e-5)


def test_token_id_input_is_used_as_given(engine):
    ids = engine.prepare([Item(text="hello world")])[0]
    assert engine.prepare([Item(token_ids=ids)]) == [ids]
    with_specials, without = engine.embed([ids, ids[1:-1]])
    assert float(with_specials @ without) < 0.9999   # no [CLS]/[SEP] were added to the second


def test_too_long_input_is_refused_unless_truncation_is_asked(engine, reference):
    long_text = "word " * 600
    with pytest.raises(InvalidInput, match="more than the model's maximum context length of 512"):
        engine.prepare([Item(text="short"), Item(text=long_text)])
    _, tok = reference
    truncated = engine.prepare([Item(text=long_text)], truncate=-1)[0]
    assert truncated == tok(long_text, truncation=True, max_length=512)["input_ids"]
    assert engine.prepare([Item(text=long_text)], truncate=10)[0] == \
        tok(long_text, truncation=True, max_length=10)["input_ids"]
    assert engine.prepare([Item(token_ids=list(range(1000, 1020)))], truncate=5) == \
        [list(range(1000, 1005))]


@pytest.mark.parametrize("item, truncate, message", [
    (Item(text=""), None, "empty string"),
    (Item(token_ids=[]), None, "no token ids"),
    (Item(token_ids=[101, 30522]), None, "outside the vocabulary"),
    (Item(token_ids=[-1]), None, "outside the vocabulary"),
    (Item(text="hi"), 0, "truncate_prompt_tokens"),
    (Item(text="hi"), 513, "truncate_prompt_tokens"),
])
def test_bad_items_are_refused_with_a_clear_error(engine, item, truncate, message):
    with pytest.raises(InvalidInput, match=message):
        engine.prepare([item], truncate=truncate)
