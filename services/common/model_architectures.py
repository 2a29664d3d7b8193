"""Which model architectures meshllm serves, and the start-up error for the others.

Read from config.json's `architectures` (model_type when a config has none), before any
other field: a directory of another family fails at start with one message that names its
architecture and lists what is served, instead of a KeyError deep in the loader. The worker's
config loader (services/worker/models/config.py) and the launcher (`meshllm serve`, before it
starts any process) both check here; torch-free."""
from __future__ import annotations

import json
from pathlib import Path

# architecture -> its family (all load through the worker's Llama layout, worker/models/llama.py)
SERVED_ARCHITECTURES = {
    "LlamaForCausalLM": "Llama (Llama 2, Llama 3.x, SmolLM2)",
    "MistralForCausalLM": "Mistral",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5",
    "Qwen3ForCausalLM": "Qwen3",
}
SERVED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Families vLLM 0.25 removed: named in the error, so an operator moving from an older vLLM
# knows the model is not merely misconfigured.
REMOVED_IN_VLLM_0_25 = {
    "BaichuanForCausalLM": "Baichuan", "BaiChuanForCausalLM": "Baichuan",
    "AquilaForCausalLM": "Aquila", "AquilaModel": "Aquila",
    "Grok1ModelForCausalLM": "Grok", "Grok1ForCausalLM": "Grok",
    "TarsierForConditionalGeneration": "Tarsier", "Tarsier2ForConditionalGeneration": "Tarsier",
    "MantisForConditionalGeneration": "Mantis",
}
REMOVED_MODEL_TYPES = {"baichuan": "Baichuan", "aquila": "Aquila", "grok-1": "Grok", "grok": "Grok",
                       "tarsier": "Tarsier", "mantis": "Mantis"}


def served_families() -> str:
    return "; ".join(f"{family}: {arch}" for arch, family in SERVED_ARCHITECTURES.items())


def unserved_reason(cfg: dict) -> str | None:
    """Why the model of this config.json cannot be served, or None when it can."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if archs:
        if any(a in SERVED_ARCHITECTURES for a in archs):
            return None
        what = f"model architecture {', '.join(map(str, archs))}"
        removed = next((REMOVED_IN_VLLM_0_25[a] for a in archs if a in REMOVED_IN_VLLM_0_25), None)
    else:
        model_type = cfg.get("model_type", "llama")
        if model_type in SERVED_MODEL_TYPES:
            return None
        what = f"model_type {model_type!r} (config.json has no architectures)"
        removed = REMOVED_MODEL_TYPES.get(str(model_type).lower())
    note = f" ({removed} was removed in vLLM 0.25 and is not served here either)" if removed else ""
    return f"{what} is not served by meshllm{note}. Served families: {served_families()}"


def check_model_dir(model_dir: str | Path) -> None:
    """Raise ValueError (the message of unserved_reason) unless the directory's config.json
    names an architecture this worker serves. A missing or unreadable config.json is the
    loader's error to report."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    reason = unserved_reason(cfg) if isinstance(cfg, dict) else None
    if reason:
        raise ValueError(f"{model_dir}: {reason}")
