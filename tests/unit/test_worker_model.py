"""Our Llama forward over the paged KV cache equals transformers' logits (float32)."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention import SeqSchedule, build_attn_metadata
from services.worker.models import load_model, load_model_config
from tests.unit.tiny_llama import VOCAB, hf_family_model, hf_model, make_tiny_family, make_tiny_llama

ATOL = 1e-4
BLOCK = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of every position from one full transformers forward."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


class Paged:
    """Our model + a KV cache, stepped with explicit (tokens, block table, start, count)."""

    def __init__(self, model, num_blocks: int = 64) -> None:
        self.model = model
        self.cache = [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK)) for _ in model.layers]

    def step(self, seqs: list[tuple[list[int], list[int], int, int]]) -> list[torch.Tensor]:
        """seqs: (token_ids, block_ids, start, count), single-token ones first.
        Returns each sequence's logits [count, V]."""
        ids, pos, sched = [], [], []
        for toks, blocks, start, count in seqs:
            ids += toks[start:start + count]
            pos += range(start, start + count)
            sched.append(SeqSchedule(blocks, start, count))
        meta = build_attn_metadata(sched, BLOCK, CPU, self.model.cfg.sliding_window)
        hidden = self.model.forward(torch.tensor(ids), torch.tensor(pos), meta, self.cache)
        logits = self.model.compute_logits(hidden)
        return list(logits.split([s[3] for s in seqs]))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill_matches_transformers(tiny_dir):
    model, hf = load_model(tiny_dir), hf_model(tiny_dir)
    ids = prompt(23, 1)
    (ours,) = Paged(model).step([(ids, [5, 2, 9, 0, 7, 11], 0, len(ids))])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_over_shuffled_blocks_matches_transformers(tiny_dir):
    model, hf = load_model(tiny_dir), hf_model(tiny_dir)
    ids = prompt(22, 2)                      # 22 = 5 full blocks of 4 + a partial one
    blocks = [13, 3, 40, 8, 1, 27]           # non-contiguous, unordered
    paged = Paged(model)
    chunks = [(0, 5), (5, 3), (8, 1), (9, 13)]  # chunk boundaries inside and across blocks
    ours = torch.cat([paged.step([(ids, blocks, s, c)])[0] for s, c in chunks])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_decode_steps_match_transformers(tiny_dir):
    model, hf = load_model(tiny_dir), hf_model(tiny_dir)
    ids = prompt(30, 3)
    blocks = [20, 4, 17, 2, 9, 31, 6, 12]
    paged = Paged(model)
    first = paged.step([(ids, blocks, 0, 10)])[0]
    decodes = [paged.step([(ids, blocks, p, 1)])[0] for p in range(10, 30)]
    ours = torch.cat([first, *decodes])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_mixed_batch_of_prefill_chunk_and_decodes_matches_transformers(tiny_dir):
    model, hf = load_model(tiny_dir), hf_model(tiny_dir)
    paged = Paged(model)
    a, b, c = prompt(19, 4), prompt(9, 5), prompt(14, 6)
    ta, tb, tc = [3, 30, 12, 50, 21], [7, 44, 18], [60, 1, 35, 22]
    # b and c prefill their first tokens; a caches a prefix of 6 tokens.
    paged.step([(b, tb, 0, 6), (c, tc, 0, 11), (a, ta, 0, 6)])
    got = {"a": [], "b": [], "c": []}
    # Three mixed steps: b and c decode one token each while a prefills in chunks.
    for step, (sa, ca) in enumerate([(6, 5), (11, 4), (15, 4)]):
        pb_, pc = 6 + step, 11 + step
        lb, lc, la = paged.step([(b, tb, pb_, 1), (c, tc, pc, 1), (a, ta, sa, ca)])
        got["b"].append(lb)
        got["c"].append(lc)
        got["a"].append(la)
    torch.testing.assert_close(torch.cat(got["a"]), hf_logits(hf, a)[6:19], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got["b"]), hf_logits(hf, b)[6:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got["c"]), hf_logits(hf, c)[11:14], atol=ATOL, rtol=0)


def test_batched_decodes_of_different_lengths_match_transformers(tiny_dir):
    model, hf = load_model(tiny_dir), hf_model(tiny_dir)
    paged = Paged(model, num_blocks=128)
    lens = [3, 17, 8, 1, 12]
    seqs = [prompt(n + 4, 10 + i) for i, n in enumerate(lens)]
    tables = [list(range(100 - 10 * i, 100 - 10 * i - 6, -1)) for i in range(len(lens))]
    for s, t, n in zip(seqs, tables, lens):
        paged.step([(s, t, 0, n)])
    for k in range(4):
        outs = paged.step([(s, t, n + k, 1) for s, t, n in zip(seqs, tables, lens)])
        for s, n, out in zip(seqs, lens, outs):
            torch.testing.assert_close(out[0], hf_logits(hf, s)[n + k], atol=ATOL, rtol=0)


def test_tied_embeddings_match_transformers(tmp_path):
    d = make_tiny_llama(tmp_path, tie=True, seed=3)
    model, hf = load_model(d), hf_model(d)
    assert model.lm_head is model.embed
    ids = prompt(11, 7)
    (ours,) = Paged(model).step([(ids, [2, 0, 1], 0, len(ids))])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    d = make_tiny_llama(tmp_path, rope_scaling=scaling, seed=4)
    cfg = load_model_config(d)
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    model, hf = load_model(d), hf_model(d)
    ids = prompt(70, 8)                      # past original_max_position_embeddings
    paged = Paged(model)
    blocks = list(range(30, 12, -1))
    ours = torch.cat([paged.step([(ids, blocks, 0, 40)])[0],
                      *[paged.step([(ids, blocks, p, 1)])[0] for p in range(40, 70)]])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_eos_ids_merge_config_and_generation_config(tiny_dir):
    assert load_model_config(tiny_dir).eos_token_ids == (2, 3)


@pytest.mark.parametrize("family,extra", [
    ("mistral", {"sliding_window": 6, "head_dim": 8}),
    ("qwen2", {"use_sliding_window": False}),
    ("qwen3", {"head_dim": 16}),
], ids=["mistral-sliding-window", "qwen2-qkv-bias", "qwen3-qk-norm"])
def test_other_llama_family_layouts_match_transformers(tmp_path, family, extra):
    d = make_tiny_family(tmp_path, family, seed=5, **extra)
    cfg = load_model_config(d)
    if family == "mistral":
        assert cfg.sliding_window == 6
    elif family == "qwen3":
        assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 16
    else:
        assert cfg.attention_bias
    model, hf = load_model(d), hf_family_model(d)
    ids = prompt(21, 9)
    paged = Paged(model)
    blocks = [9, 4, 17, 2, 11, 6]
    ours = torch.cat([paged.step([(ids, blocks, 0, 8)])[0], paged.step([(ids, blocks, 8, 7)])[0],
                      *[paged.step([(ids, blocks, p, 1)])[0] for p in range(15, 21)]])
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)
