"""Our own torch implementations of the supported model families (HF-format directories)."""
from services.worker.models.config import ModelConfig, load_model_config
from services.worker.models.llama import LlamaModel
from services.worker.models.loader import load_model

__all__ = ["ModelConfig", "LlamaModel", "load_model", "load_model_config"]
