"""The GGUF -> HF converter on small inputs: the q/k unpermute, name mapping, and a whole tiny
random Llama written as GGUF (the way llama.cpp does) and converted back."""
from __future__ import annotations

import json

import numpy as np
import pytest

from services.models.gguf_to_hf import convert_gguf_to_hf, hf_tensor_name, unpermute_qk


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


@pytest.mark.parametrize("shape, n_head", [
    ((576, 576), 9),    # SmolLM2 q_proj: 9 heads x 64
    ((192, 576), 3),    # SmolLM2 k_proj: 3 kv heads x 64
    ((256,), 4),        # a q bias: 1-D works too
    ((64, 8, 3), 2),    # any trailing dims
])
def test_unpermute_inverts_llama_cpp_permutation(shape, n_head):
    weight = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(weight, n_head)
    assert not np.array_equal(permuted, weight)
    restored = unpermute_qk(permuted, n_head)
    assert restored.shape == weight.shape
    np.testing.assert_array_equal(restored, weight)


def test_llama_cpp_layout_interleaves_rotary_halves_and_unpermute_restores_them():
    # One head of dim 8: HF keeps rotary halves [0 1 2 3 | 4 5 6 7]; llama.cpp rotates
    # adjacent pairs, so its rows are [0 4 1 5 2 6 3 7].
    gguf_rows = np.array([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])
    np.testing.assert_array_equal(llama_cpp_permute(np.arange(16), 2), gguf_rows)
    np.testing.assert_array_equal(unpermute_qk(gguf_rows, 2), np.arange(16))


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError):
        unpermute_qk(np.zeros((30, 4)), 4)


@pytest.mark.parametrize("gguf_name, hf_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.12.attn_k.weight", "model.layers.12.self_attn.k_proj.weight"),
    ("blk.3.attn_v.bias", "model.layers.3.self_attn.v_proj.bias"),
    ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
    ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
    ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
    ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),
    ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
    ("rope_freqs.weight", None),
])
def test_gguf_tensor_names_map_to_hf_llama_names(gguf_name, hf_name):
    assert hf_tensor_name(gguf_name) == hf_name


def test_unknown_gguf_tensor_is_an_error_not_silently_dropped():
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


# --- a tiny random Llama, written as llama.cpp would, then converted back ----------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens (type 3)
USER_DEFINED = ["<think>"]                                  # user-defined token (type 4)
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]


def _byte_alphabet() -> list[str]:
    from services.models.gguf_tokenizer import bytes_to_unicode
    return [bytes_to_unicode()[b] for b in range(256)]


def _tiny_vocab() -> tuple[list[str], list[int]]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = SPECIALS + USER_DEFINED + _byte_alphabet() + merged
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [1] * (256 + len(merged))
    return tokens, types


def _hf_to_gguf_name(name: str) -> str:
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in table:
        return table[name]
    parts = name.split(".")  # model.layers.N.<module>.<proj>.weight
    layer, module = parts[2], ".".join(parts[3:-1])
    gguf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm"}[module]
    return f"blk.{layer}.{gguf}.weight"


def write_tiny_gguf(path, model, *, pre: str, add_bos: bool) -> None:
    import gguf

    cfg = model.config
    tokens, types = _tiny_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, tensor in model.state_dict().items():
        array = tensor.detach().numpy().astype(np.float32)
        if ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads, cfg.num_attention_heads)
        elif ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads, cfg.num_key_value_heads)
        writer.add_tensor(_hf_to_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(_tiny_vocab()[0]), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms too, so a swapped norm would show
            param.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(root / "tiny.gguf", tiny_llama, pre="smollm", add_bos=False)
    return convert_gguf_to_hf(root / "tiny.gguf", root / "hf")


def test_converted_tiny_llama_gives_the_original_logits(tiny_llama, converted):
    import torch
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tiny_llama(ids).logits, rtol=0, atol=1e-6)


def test_converted_config_states_the_gguf_hyperparameters(tiny_llama, converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 96, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["tie_word_embeddings"] is False  # the file has output.weight
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["max_position_embeddings"] == 128
    assert json.loads((converted / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_converted_tokenizer_keeps_special_tokens_whole_and_splits_digits(converted):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    text = "hello world 12<|im_start|><think>"
    ids = tok.encode(text).ids
    assert [tok.id_to_token(i) for i in ids] == [
        "hello", "Ġwor", "l", "d", "Ġ", "1", "2", "<|im_start|>", "<think>"]
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Control tokens vanish with skip_special_tokens; user-defined ones are text.
    assert tok.decode(ids, skip_special_tokens=True) == "hello world 12<think>"


def test_converted_tokenizer_config_carries_template_and_special_tokens(converted):
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{% for m in messages %}")
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False and config["model_max_length"] == 128


def test_gguf_asking_for_bos_gets_it_prepended(tiny_llama, tmp_path):
    from tokenizers import Tokenizer

    write_tiny_gguf(tmp_path / "bos.gguf", tiny_llama, pre="llama-bpe", add_bos=True)
    out = convert_gguf_to_hf(tmp_path / "bos.gguf", tmp_path / "hf")
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode("hello").ids
    assert ids[0] == 1 and len(ids) == 2
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_unknown_pre_tokenizer_is_refused(tiny_llama, tmp_path):
    write_tiny_gguf(tmp_path / "odd.gguf", tiny_llama, pre="no-such-split", add_bos=False)
    with pytest.raises(ValueError, match="no-such-split"):
        convert_gguf_to_hf(tmp_path / "odd.gguf", tmp_path / "hf")
