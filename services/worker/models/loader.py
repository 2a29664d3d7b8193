"""Load an HF-format Llama-family directory with safetensors (never pickle / torch.load)."""
from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.models.config import ModelConfig, ModelConfigError, load_model_config
from services.worker.models.llama import LayerWeights, LlamaModel

log = logging.getLogger(__name__)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"no *.safetensors files in {model_dir}")
    return files


class _Tensors:
    """Name -> tensor across shards, cast to the serving dtype on the target device."""

    def __init__(self, files: list[Path], stack: ExitStack, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.where: dict[str, object] = {}
        for f in files:
            handle = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for name in handle.keys():
                self.where[name] = handle
        self.dtype, self.device = dtype, device
        self.prefix = "model." if "model.embed_tokens.weight" in self.where else ""

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ModelConfigError(f"weight {name!r} missing from the checkpoint")
        return self.where[name].get_tensor(name).to(device=self.device, dtype=self.dtype)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None


def _cat_or_none(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ModelConfigError("some but not all fused projections have a bias")
    return torch.cat(parts, dim=0).contiguous()


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ModelConfigError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def load_model(model_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, max_model_len: int | None = None) -> LlamaModel:
    model_dir = Path(model_dir)
    cfg: ModelConfig = load_model_config(model_dir)
    device = torch.device(device)
    max_len = max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ModelConfigError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                               f"{cfg.max_position_embeddings}")
    nh, kvh, d, hsz = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    with ExitStack() as stack:
        w = _Tensors(_weight_files(model_dir), stack, dtype, device)
        p = w.prefix
        embed = w.get(f"{p}embed_tokens.weight")
        _check_shape("embed_tokens", embed, (cfg.vocab_size, hsz))
        layers = []
        for i in range(cfg.num_layers):
            a, m = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp."
            qkv = torch.cat([w.get(a + "q_proj.weight"), w.get(a + "k_proj.weight"),
                             w.get(a + "v_proj.weight")], dim=0).contiguous()
            _check_shape(f"layer {i} qkv", qkv, ((nh + 2 * kvh) * d, hsz))
            gate_up = torch.cat([w.get(m + "gate_proj.weight"), w.get(m + "up_proj.weight")],
                                dim=0).contiguous()
            _check_shape(f"layer {i} gate_up", gate_up, (2 * cfg.intermediate_size, hsz))
            layers.append(LayerWeights(
                input_norm=w.get(f"{p}layers.{i}.input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=_cat_or_none([w.maybe(a + "q_proj.bias"), w.maybe(a + "k_proj.bias"),
                                       w.maybe(a + "v_proj.bias")]),
                o=w.get(a + "o_proj.weight"),
                o_bias=w.maybe(a + "o_proj.bias"),
                post_norm=w.get(f"{p}layers.{i}.post_attention_layernorm.weight"),
                gate_up=gate_up,
                gate_up_bias=_cat_or_none([w.maybe(m + "gate_proj.bias"), w.maybe(m + "up_proj.bias")]),
                down=w.get(m + "down_proj.weight"),
                down_bias=w.maybe(m + "down_proj.bias"),
                q_norm=w.get(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=w.get(a + "k_norm.weight") if cfg.qk_norm else None,
            ))
        final_norm = w.get(f"{p}norm.weight")
        if cfg.tie_word_embeddings or not w.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = w.get("lm_head.weight")
            _check_shape("lm_head", lm_head, (cfg.vocab_size, hsz))
    log.info("loaded %s: %d layers, hidden %d, heads %d/%d, vocab %d, %s on %s",
             model_dir.name, cfg.num_layers, hsz, nh, kvh, cfg.vocab_size, dtype, device)
    return LlamaModel(cfg, embed, layers, final_norm, lm_head, max_len)
