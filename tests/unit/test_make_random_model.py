"""bench/make_random_model.py writes a directory our loader and transformers both load, to the same
logits, with the same bytes for the same seed and the shapes its flags ask for."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from bench.make_random_model import PRESETS, main, make_random_model
from services.worker.attention import SeqSchedule, build_attn_metadata
from services.worker.models import load_model

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return make_random_model(tmp_path_factory.mktemp("tiny"), PRESETS["tiny"], seed=0, tokenizer_dir=smollm2_dir,
                             log=lambda *_: None)


def our_logits(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of one prefill through our loader and forward."""
    model = load_model(model_dir, "cpu", torch.float32)
    n_blocks = -(-len(ids) // BLOCK)
    cache = [torch.zeros(model.kv_cache_shape(n_blocks, BLOCK)) for _ in model.layers]
    meta = build_attn_metadata([SeqSchedule(list(range(n_blocks)), 0, len(ids))], BLOCK, torch.device("cpu"), None)
    return model.compute_logits(model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, cache))


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def digest(model_dir) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def test_tiny_model_gives_the_same_logits_in_our_loader_and_transformers(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    ids = torch.randint(0, cfg["vocab_size"], (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, theirs = our_logits(tiny, ids), hf_logits(tiny, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert ours.isfinite().all() and 0.5 < ours.std() < 2.0   # the init keeps logits spread, not flat or huge


def test_directory_carries_the_tokenizer_its_vocabulary_and_stop_ids(tiny, smollm2_dir):
    from tokenizers import Tokenizer
    cfg = json.loads((tiny / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert cfg["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == 49152
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == cfg["eos_token_id"]
    assert "chat_template" in json.loads((tiny / "tokenizer_config.json").read_text())
    assert (tiny / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()


def test_same_seed_writes_the_same_bytes_and_another_seed_does_not(tiny, tmp_path, smollm2_dir):
    again = make_random_model(tmp_path / "again", PRESETS["tiny"], seed=0, tokenizer_dir=smollm2_dir, log=lambda *_: None)
    other = make_random_model(tmp_path / "other", PRESETS["tiny"], seed=1, tokenizer_dir=smollm2_dir, log=lambda *_: None)
    assert digest(again) == digest(tiny)
    assert digest(other) != digest(tiny)


def test_shape_flags_tied_embeddings_and_shards_load_in_both(tmp_path, smollm2_dir):
    d = tmp_path / "flags"
    assert main([str(d), "--preset", "tiny", "--hidden", "96", "--layers", "3", "--heads", "6", "--kv-heads", "3",
                 "--intermediate", "160", "--tie-word-embeddings", "--max-shard-gb", str(4 / 1024),
                 "--tokenizer-dir", str(smollm2_dir), "--seed", "7"]) == 0
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["head_dim"]) == (96, 3, 6, 3, 160, 16)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"]      # tied: lm_head is the embedding
    model = load_model(d, "cpu", torch.float32)
    assert tuple(model.layers[0].qkv.shape) == ((6 + 2 * 3) * 16, 96)
    assert tuple(model.layers[2].gate_up.shape) == (2 * 160, 96) and model.lm_head is model.embed
    ids = list(range(100, 120))
    torch.testing.assert_close(our_logits(d, ids), hf_logits(d, ids), atol=1e-4, rtol=1e-4)


def test_inconsistent_shape_flags_are_refused(tmp_path, smollm2_dir, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--preset", "tiny", "--heads", "6", "--kv-heads", "4",
              "--tokenizer-dir", str(smollm2_dir)])
    assert "multiple of --kv-heads" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
