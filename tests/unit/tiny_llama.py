"""Tiny random-weight Llama checkpoints written by transformers (the oracle) for worker tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96


def make_tiny_llama(path: Path, *, tie: bool = False, rope_scaling: dict | None = None,
                    seed: int = 0, max_pos: int = 256, vocab: int = VOCAB) -> Path:
    """hidden 48, 6 query heads / 2 kv heads (GQA ratio 3), head_dim 8, 2 layers. `vocab` lets a
    real tokenizer drive it (tests/integration/test_tensor_parallel.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = {}
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
        kwargs["rope_theta"] = 500000.0
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=max_pos,
                      tie_word_embeddings=tie, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      **kwargs)
    model = LlamaForCausalLM(cfg).eval()
    # Random init is tiny (std 0.02): scale up so logits are spread and argmax ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" not in name else 1.0)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return path


def hf_model(path: Path):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_tiny_family(path: Path, family: str, seed: int = 0, **extra) -> Path:
    """A tiny Mistral (sliding window) or Qwen2 (qkv bias) checkpoint of the same shape."""
    import transformers

    torch.manual_seed(seed)
    cfg_cls, model_cls = {"mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" not in name else 1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5)  # biases
    model.save_pretrained(path)
    return path


def hf_family_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
