"""Convert a llama-architecture GGUF file into an HF-format model directory.

The output is what every other part of meshllm loads: config.json, model.safetensors,
generation_config.json, tokenizer.json and tokenizer_config.json (see gguf_tokenizer.py).

Weights are dequantized to float32 and stored as float32. A Q4_1 value is d*q + m with
fp16 d, m and a 4-bit q, a Q8_0 value is d*q with an 8-bit q: they need up to ~19 bits
of mantissa, so fp16 or bf16 storage would round them and the converted model would no
longer match transformers' own GGUF loading (which dequantizes to fp32) bit for bit. For
SmolLM2-135M that is ~540 MB on disk; a worker casts to bf16/fp16 at load time if it wants.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_fields import field_value
from .gguf_tokenizer import build_tokenizer_files

# Bump when the output of the conversion changes; prepare_model() rebuilds older outputs.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor name -> HF LlamaForCausalLM name (without the "model.layers.N." prefix).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFModelInfo:
    """The hyper-parameters of a llama GGUF, read from its metadata."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    rope_scaling: dict | None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} heads are not a multiple of "
                             f"{self.num_key_value_heads} kv heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")


def _clean_float(value) -> float:
    # GGUF stores float32; str() of a float32 is its shortest repr (1e-05, not 9.9999997e-06),
    # which parses back to the very same float32, so the config stays readable and exact.
    return float(str(np.float32(value)))


def read_model_info(reader) -> GGUFModelInfo:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")

    def meta(key: str, default=None, required: bool = False):
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(meta("embedding_length", required=True))
    heads = int(meta("attention.head_count", required=True))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", hidden // heads))
    # The embedding's row count is the model's vocab size (it may exceed the token list).
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    vocab = int(embedding.shape[-1])  # GGUF dims are [hidden, vocab]
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1-style scaling: llama.cpp bakes the per-frequency factors into a tensor and
        # drops the parameters HF needs (low/high_freq_factor), so it cannot be reproduced here.
        raise ValueError("GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported")
    return GGUFModelInfo(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length", required=True)),
        num_hidden_layers=int(meta("block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_clean_float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_clean_float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", required=True)),
        vocab_size=int(vocab),
        rope_scaling=_rope_scaling(meta),
    )


def _rope_scaling(meta) -> dict | None:
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _clean_float(factor)}
    if kind == "yarn" and factor:
        scaling = {"rope_type": "yarn", "factor": _clean_float(factor)}
        original = meta("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported")


# --- llama.cpp's q/k permutation -------------------------------------------------------------
#
# HF Llama applies rotary embeddings to the two *halves* of each head (rotate_half); llama.cpp
# (GGML_ROPE_TYPE_NORM) rotates *adjacent pairs*. Its converter therefore reorders the output
# rows of q_proj (with n_head) and k_proj (with n_head_kv) so that, within each head, row
# (pair i, half h) moves to position 2*i + h. We undo that to get back HF's layout.

def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation. weight: [n_head * head_dim, *rest]."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_qk. weight: [n_head * head_dim, *rest] -> same shape, HF row order."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of pairs")
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor; None for tensors HF does not keep (rotary tables)."""
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    match = _GLOBAL_RE.match(gguf_name)
    if match:
        part, kind = match.groups()
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    if gguf_name.endswith(("rope_freqs.weight", ".attn_rot_embd")):
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF Llama equivalent")


def iter_hf_tensors(reader, info: GGUFModelInfo) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF [out, in] layout) for every tensor of the file."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        # GGUF lists dims innermost-first (ne0 = in_features); numpy wants them reversed, which
        # is exactly HF's [out_features, in_features].
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = np.ascontiguousarray(
            dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape))
        if ".self_attn.q_proj." in name:
            array = unpermute_qk(array, info.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            array = unpermute_qk(array, info.num_key_value_heads)
        yield name, np.ascontiguousarray(array)


def _check_shapes(tensors: dict[str, np.ndarray], info: GGUFModelInfo) -> None:
    h, q, kv = info.hidden_size, info.num_attention_heads * info.head_dim, \
        info.num_key_value_heads * info.head_dim
    expected = {"model.embed_tokens.weight": (info.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(info.num_hidden_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (info.intermediate_size, h),
            p + "mlp.up_proj.weight": (info.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, info.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"GGUF lacks tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(f"{name} has shape {tensors[name].shape}, expected {shape}")


def build_config(info: GGUFModelInfo, reader, tied: bool, attention_bias: bool) -> dict:
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    pad = field_value(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size,
        "num_hidden_layers": info.num_hidden_layers,
        "num_attention_heads": info.num_attention_heads,
        "num_key_value_heads": info.num_key_value_heads,
        "head_dim": info.head_dim,
        "rms_norm_eps": info.rms_norm_eps,
        "rope_theta": info.rope_theta,
        "max_position_embeddings": info.max_position_embeddings,
        "vocab_size": info.vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if info.rope_scaling is not None:
        config["rope_scaling"] = info.rope_scaling
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if value is not None:
            config[key] = int(value)
    return config


def generation_config(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF-format Llama directory for `gguf_path` into `out_dir` (created if needed).

    Not atomic by itself: prepare_model() writes into a temporary directory and renames it.
    """
    import gguf
    from safetensors.numpy import save_file


    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    info = read_model_info(reader)

    tensors = dict(iter_hf_tensors(reader, info))
    tied = "lm_head.weight" not in tensors
    _check_shapes(tensors, info)
    attention_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    config = build_config(info, reader, tied, attention_bias)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(config))
    tokenizer_json, tokenizer_config = build_tokenizer_files(reader, info.max_position_embeddings)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config)
    return out
