"""TokenizerCore: loading a model dir's tokenizer files, encoding, GetInfo fields."""
import json

import pytest

from services.tokenizer.core import TokenizerCore, TokenizerLoadError
from services.tokenizer.testing import build_byte_level_bpe, write_tiny_tokenizer_dir

TEXTS = ["Hello world!", "", "  leading spaces and\ttabs\n", "Café 日本語 😀👍🏽",
         "<|im_start|>user\nhi<|im_end|>", "x" * 3000]


@pytest.fixture(scope="module")
def smollm2_core(smollm2_dir):
    return TokenizerCore.from_dir(smollm2_dir)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_smollm2_encode_batch_matches_transformers(smollm2_dir, smollm2_core, add_special_tokens):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    expected = [hf(t, add_special_tokens=add_special_tokens)["input_ids"] for t in TEXTS]
    assert smollm2_core.encode_batch(TEXTS, add_special_tokens) == expected


def test_smollm2_info_names_chatml_special_tokens_and_context(smollm2_core):
    info = smollm2_core.info()
    assert info.vocab_size == 49152
    assert info.bos_token_id == smollm2_core.tokenizer.token_to_id("<|im_start|>")
    assert smollm2_core.tokenizer.token_to_id("<|im_end|>") in info.eos_token_ids
    assert info.has_chat_template is True
    assert info.model_max_length == 8192


def test_info_merges_eos_ids_from_tokenizer_and_generation_config(tmp_path):
    core = TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path, eos_token_id=[2, 0],
                                                           max_position_embeddings=1234))
    info = core.info()
    assert info.eos_token_ids == (2, 0)        # <|im_end|> first, then <|endoftext|>
    assert info.bos_token_id == 1
    assert info.vocab_size == 400
    assert info.model_max_length == 1234


def test_empty_batch_encodes_to_nothing(tmp_path):
    core = TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path))
    assert core.encode_batch([], add_special_tokens=True) == []
    assert core.encode_batch([""], add_special_tokens=False) == [[]]


def test_add_bos_token_in_tokenizer_config_prepends_bos(tmp_path):
    plain = TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path / "plain"))
    with_bos = TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path / "bos", add_bos_token=True))
    ids = plain.encode_batch(["Hello world"], add_special_tokens=True)[0]
    assert ids[0] != 1
    assert with_bos.encode_batch(["Hello world"], add_special_tokens=True)[0] == [1, *ids]
    assert with_bos.encode_batch(["Hello world"], add_special_tokens=False)[0] == ids


def test_truncation_saved_in_tokenizer_json_does_not_cut_prompts(tmp_path):
    root = write_tiny_tokenizer_dir(tmp_path)
    tok = build_byte_level_bpe()
    tok.enable_truncation(max_length=4)
    tok.save(str(root / "tokenizer.json"))
    core = TokenizerCore.from_dir(root)
    assert len(core.encode_batch(["the quick brown fox jumps over the lazy dog"], False)[0]) > 4


def test_chat_template_is_found_in_named_list_jinja_file_or_override(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    listed = write_tiny_tokenizer_dir(tmp_path / "listed", chat_template=None)
    cfg = json.loads((listed / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                            {"name": "default", "template": "DEFAULT {{ messages[0].content }}"}]
    (listed / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert TokenizerCore.from_dir(listed).apply_chat_template(
        messages, add_generation_prompt=False) == "DEFAULT hi"

    jinja = write_tiny_tokenizer_dir(tmp_path / "jinja", chat_template=None)
    (jinja / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    assert TokenizerCore.from_dir(jinja).apply_chat_template(
        messages, add_generation_prompt=False) == "JINJA hi"

    override = tmp_path / "override.jinja"
    override.write_text("OVERRIDE {{ bos_token }}{{ messages[0].content }}")
    core = TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path / "model"),
                                  chat_template_path=override)
    assert core.apply_chat_template(messages, add_generation_prompt=True) == "OVERRIDE <|im_start|>hi"


def test_missing_tokenizer_json_or_bad_template_fails_loading(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        TokenizerCore.from_dir(tmp_path)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    with pytest.raises(TokenizerLoadError, match="does not compile"):
        TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path / "m"), chat_template_path=bad)


def test_smollm2_ids_to_tokens_matches_transformers_convert_ids_to_tokens(smollm2_dir, smollm2_core):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = smollm2_core.encode_batch(["What is 😀 here? Café"], False)[0]
    tokens = smollm2_core.ids_to_tokens(ids)
    assert tokens == hf.convert_ids_to_tokens(ids)
    assert "Ġis" in tokens and not any("\ufffd" in t for t in tokens)


def test_smollm2_tokenizer_config_names_the_class_and_the_template_without_file_paths(smollm2_core):
    cls, template, config = smollm2_core.tokenizer_config()
    assert cls == "PreTrainedTokenizerFast"   # as tokenizer_config.json names it
    assert template == smollm2_core.chat_template.source and "<|im_start|>" in template
    assert config["eos_token"] == "<|im_end|>" and "chat_template" not in config
    assert not {"vocab_file", "merges_file"} & set(config)
    im_end = str(smollm2_core.tokenizer.token_to_id("<|im_end|>"))   # as transformers' init_kwargs
    assert config["added_tokens_decoder"][im_end]["content"] == "<|im_end|>"
    assert config["added_tokens_decoder"][im_end]["special"] is True


def test_tokenizer_class_is_the_fast_variant_transformers_4_loads(tmp_path):
    write_tiny_tokenizer_dir(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="GPT2Tokenizer", vocab_file="/secret/vocab.json")
    cfg_path.write_text(json.dumps(cfg))
    cls, template, config = TokenizerCore.from_dir(tmp_path).tokenizer_config()
    assert cls == "GPT2TokenizerFast" and "vocab_file" not in config
