"""A model directory of an architecture meshllm does not serve fails at start with one message
naming the architecture and the served families: in the worker's config loader (before any
other field is read) and in `meshllm serve` (before any process starts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.model_architectures import SERVED_ARCHITECTURES, check_model_dir, unserved_reason
from services.worker.models.config import ModelConfigError, load_model_config

ROOT = Path(__file__).resolve().parents[2]
# Shapes of the real config.json files (trimmed): note Tarsier's and Mantis' nested text_config.
REMOVED = {
    "Baichuan": {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "hidden_size": 4096,
                 "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 125696},
    "Aquila": {"architectures": ["AquilaForCausalLM"], "model_type": "aquila", "hidden_size": 4096},
    "Grok": {"architectures": ["Grok1ModelForCausalLM"], "model_type": "grok-1", "hidden_size": 6144,
             "hidden_act": "gelu"},
    "Tarsier": {"architectures": ["TarsierForConditionalGeneration"], "model_type": "llava",
                "text_config": {"model_type": "llama", "hidden_size": 4096}},
    "Mantis": {"architectures": ["MantisForConditionalGeneration"], "model_type": "llava",
               "text_config": {"model_type": "llama"}},
}


def _model_dir(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("family", sorted(REMOVED))
def test_a_family_vllm_removed_fails_naming_its_architecture_and_what_is_served(tmp_path, family):
    cfg = REMOVED[family]
    with pytest.raises(ModelConfigError) as err:
        load_model_config(_model_dir(tmp_path, cfg))
    message = str(err.value)
    assert cfg["architectures"][0] in message and family in message and "vLLM 0.25" in message
    for arch in SERVED_ARCHITECTURES:
        assert arch in message


def test_an_unknown_architecture_and_an_unknown_model_type_are_refused_too(tmp_path):
    reason = unserved_reason({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    assert reason.startswith("model architecture FalconForCausalLM is not served") and "Qwen3ForCausalLM" in reason
    assert "vLLM 0.25" not in reason
    assert "'gpt2'" in unserved_reason({"model_type": "gpt2"})          # no architectures: model_type
    assert unserved_reason({"model_type": "qwen2"}) is None
    assert unserved_reason({"architectures": ["Qwen3ForCausalLM"]}) is None


def test_the_served_model_passes_the_check_and_loads(smollm2_dir):
    check_model_dir(smollm2_dir)
    assert load_model_config(smollm2_dir).model_type == "llama"


def test_meshllm_serve_exits_at_once_with_the_message(tmp_path):
    model = _model_dir(tmp_path, REMOVED["Baichuan"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
    run = subprocess.run([sys.executable, "-c", "import sys; from services.cli.main import main; sys.exit(main())",
                          "serve", str(model), "--port", "0", "--grpc-port", "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "BaichuanForCausalLM is not served by meshllm" in run.stderr and "LlamaForCausalLM" in run.stderr
    assert "started" not in run.stdout + run.stderr     # nothing was launched
