"""Load an HF-format Llama-family directory with safetensors (never pickle / torch.load)."""
from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.models.config import ModelConfig, ModelConfigError, load_model_config
from services.worker.models.fp8 import (FP8, QUANTIZATIONS, Fp8Weight, checkpoint_fp8_scheme, from_checkpoint,
                                        quantize_weight)
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

    def raw(self, name: str) -> torch.Tensor:
        """As stored (an FP8 weight or its float32 scale), on the target device."""
        if name not in self.where:
            raise ModelConfigError(f"weight {name!r} missing from the checkpoint")
        return self.where[name].get_tensor(name).to(device=self.device)


class _Projections:
    """Reads one projection (q_proj, gate_proj, ...) as the serving format wants it: a tensor in
    the serving dtype, or an Fp8Weight (stored FP8 kept as is; bf16 quantised with --quantization fp8)."""

    def __init__(self, w: _Tensors, stored_fp8: bool, quantize: bool) -> None:
        self.w, self.stored_fp8, self.quantize = w, stored_fp8, quantize

    def get(self, prefix: str):
        name = prefix + ".weight"
        raw = self.w.raw(name)
        if raw.dtype == FP8:
            if not self.stored_fp8:
                raise ModelConfigError(f"{name} is FP8 but config.json has no FP8 quantization_config")
            for key, inverse in (("weight_scale", False), ("weight_scale_inv", True)):
                if self.w.has(f"{prefix}.{key}"):
                    try:
                        return from_checkpoint(raw, self.w.raw(f"{prefix}.{key}"), inverse)
                    except ValueError as exc:
                        raise ModelConfigError(f"{name}: {exc}") from None
            raise ModelConfigError(f"{name} is FP8 but the checkpoint has no {prefix}.weight_scale")
        t = raw.to(self.w.dtype)
        return quantize_weight(t) if self.quantize or self.stored_fp8 else t

    @staticmethod
    def fused(parts: list):
        if all(isinstance(p, Fp8Weight) for p in parts):
            return Fp8Weight.cat(parts)
        if any(isinstance(p, Fp8Weight) for p in parts):
            raise ModelConfigError("a fused projection mixes FP8 and unquantised parts")
        return torch.cat(parts, dim=0).contiguous()


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
               dtype: torch.dtype = torch.float32, max_model_len: int | None = None,
               quantization: str = "none") -> LlamaModel:
    """`quantization` "fp8": the projections become per-channel FP8 (models/fp8.py). A checkpoint
    already stored in FP8 is served in FP8 whatever `quantization` says (never dequantised)."""
    model_dir = Path(model_dir)
    cfg: ModelConfig = load_model_config(model_dir)
    if quantization not in QUANTIZATIONS:
        raise ModelConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    try:
        stored = checkpoint_fp8_scheme(json.loads((model_dir / "config.json").read_text()))
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from None
    device = torch.device(device)
    max_len = max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ModelConfigError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                               f"{cfg.max_position_embeddings}")
    nh, kvh, d, hsz = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    with ExitStack() as stack:
        w = _Tensors(_weight_files(model_dir), stack, dtype, device)
        proj = _Projections(w, stored == "fp8", quantization == "fp8")
        p = w.prefix
        embed = w.get(f"{p}embed_tokens.weight")
        _check_shape("embed_tokens", embed, (cfg.vocab_size, hsz))
        layers = []
        for i in range(cfg.num_layers):
            a, m = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp."
            qkv = proj.fused([proj.get(a + "q_proj"), proj.get(a + "k_proj"), proj.get(a + "v_proj")])
            _check_shape(f"layer {i} qkv", qkv, ((nh + 2 * kvh) * d, hsz))
            gate_up = proj.fused([proj.get(m + "gate_proj"), proj.get(m + "up_proj")])
            _check_shape(f"layer {i} gate_up", gate_up, (2 * cfg.intermediate_size, hsz))
            o, down = proj.get(a + "o_proj"), proj.get(m + "down_proj")
            _check_shape(f"layer {i} o", o, (hsz, nh * d))
            _check_shape(f"layer {i} down", down, (hsz, cfg.intermediate_size))
            layers.append(LayerWeights(
                input_norm=w.get(f"{p}layers.{i}.input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=_cat_or_none([w.maybe(a + "q_proj.bias"), w.maybe(a + "k_proj.bias"),
                                       w.maybe(a + "v_proj.bias")]),
                o=o,
                o_bias=w.maybe(a + "o_proj.bias"),
                post_norm=w.get(f"{p}layers.{i}.post_attention_layernorm.weight"),
                gate_up=gate_up,
                gate_up_bias=_cat_or_none([w.maybe(m + "gate_proj.bias"), w.maybe(m + "up_proj.bias")]),
                down=down,
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
    log.info("loaded %s: %d layers, hidden %d, heads %d/%d, vocab %d, %s on %s%s",
             model_dir.name, cfg.num_layers, hsz, nh, kvh, cfg.vocab_size, dtype, device,
             ", FP8 projections" + (" (as stored)" if stored else "") if stored or quantization == "fp8" else "")
    return LlamaModel(cfg, embed, layers, final_norm, lm_head, max_len)
