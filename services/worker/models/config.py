"""Model hyper-parameters read from an HF-format directory (config.json, generation_config.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common.model_architectures import SERVED_MODEL_TYPES, unserved_reason

# model_type values whose checkpoints follow the Llama layout (same weight names, RoPE,
# RMSNorm, SiLU·mul MLP, GQA). Qwen2 = Llama + qkv bias; Qwen3 = Llama + per-head RMSNorm of q
# and k before RoPE (q_norm / k_norm). They load through the same path.
SUPPORTED_MODEL_TYPES = SERVED_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """The model directory cannot be served by this worker."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False              # Qwen3: RMSNorm over each q / k head before RoPE
    sliding_window: int | None = None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"unsupported model_type {self.model_type!r}; "
                                   f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_kv_heads}")
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(f"unsupported rope_scaling type {self.rope_scaling.rope_type!r}; "
                                   f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_params(cfg: dict) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (theta + type together); older files write
    # `rope_theta` and `rope_scaling` separately. Accept both.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**params, **scaling}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found")
    cfg = json.loads(path.read_text())
    reason = unserved_reason(cfg) if isinstance(cfg, dict) else "config.json is not a JSON object"
    if reason:     # before any other field: another family's config may lack them
        raise ModelConfigError(reason)
    # Some multimodal / newer configs nest the text model; Llama-family ones do not.
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    theta, rope = _rope_params(cfg)
    eos = _eos_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        # generation_config lists every stop id of chat models (e.g. Llama 3's <|eot_id|>).
        for tid in _eos_list(json.loads(gen_path.read_text()).get("eos_token_id")):
            if tid not in eos:
                eos.append(tid)
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelConfigError(f"unsupported hidden_act {hidden_act!r}")
    model_type = cfg.get("model_type", "llama")
    sliding = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        rope_scaling=rope,
        eos_token_ids=tuple(eos),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )

