"""An engine rank's KV namespace: the weights fingerprint tells checkpoints apart by what they hold
(config, tensor layout, every tensor's first bytes) without reading the weights in bulk."""
from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from services.common.kv_blocks import namespace_id
from services.common.kv_namespace import engine_namespace, weights_fingerprint


def _checkpoint(d, seed: int = 0):
    rng = np.random.default_rng(seed)
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}))
    save_file({"embed": rng.standard_normal((64, 32), dtype=np.float32),
               "layers.0.q": rng.standard_normal((32, 32), dtype=np.float32),
               "layers.1.q": rng.standard_normal((32, 32), dtype=np.float32)}, str(d / "model.safetensors"))
    return d


def test_the_same_checkpoint_has_one_fingerprint_and_any_change_another(tmp_path):
    a = _checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(b))
    # A fine-tune of one layer: same names, shapes and sizes, other values.
    tensors = load_file(str(b / "model.safetensors"))
    tensors["layers.1.q"] = tensors["layers.1.q"] + 1e-3
    save_file(tensors, str(b / "model.safetensors"))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))
    c = tmp_path / "c"
    shutil.copytree(a, c)
    (c / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3}))
    assert weights_fingerprint(str(c)) != weights_fingerprint(str(a))


def test_the_bundled_model_is_fingerprinted_without_reading_its_weights(smollm2_dir):
    t0 = time.perf_counter()
    fp = weights_fingerprint(str(smollm2_dir))
    assert time.perf_counter() - t0 < 2.0 and len(fp) == 32
    assert weights_fingerprint(str(smollm2_dir)) == fp


def test_a_directory_without_weights_or_with_a_broken_file_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .safetensors"):
        weights_fingerprint(str(tmp_path / "empty"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors"):
        weights_fingerprint(str(bad))


def test_each_rank_and_dtype_is_its_own_namespace(tmp_path):
    d = str(_checkpoint(tmp_path / "m"))
    common = dict(dtype="bfloat16", kv_cache_dtype="bfloat16", block_size=16, num_layers=2, block_bytes=8192,
                  layout="L2BHD")
    r0 = engine_namespace(d, "m", tp_size=2, tp_rank=0, **common)
    r1 = engine_namespace(d, "m", tp_size=2, tp_rank=1, **common)
    fp8 = engine_namespace(d, "m", tp_size=2, tp_rank=0, **{**common, "kv_cache_dtype": "fp8_e4m3"})
    assert len({namespace_id(r0), namespace_id(r1), namespace_id(fp8)}) == 3
    assert r0.weights_fingerprint == weights_fingerprint(d)
    with pytest.raises(ValueError, match="tp_rank"):
        engine_namespace(d, "m", tp_size=2, tp_rank=2, **common)
