"""A BERT encoder (all-MiniLM-L6-v2 and other `model_type: bert` checkpoints) in plain
torch, with the sentence-transformers pooling the model was trained for.

Prefill only: no KV cache, no causal mask. A batch is padded to its longest item and
padding is masked out of attention and of the mean pooling, so an item's vector does not
depend on what it was batched with (up to float rounding).
Weights come from safetensors (never pickle); transformers is only the tests' oracle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


class BertConfigError(ValueError):
    """The model directory is not a BERT encoder this module can serve."""


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pooling: str = "mean"        # "mean" or "cls" (sentence-transformers' 1_Pooling)
    normalize: bool = True       # sentence-transformers' Normalize module (L2)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "BertConfig":
        model_dir = Path(model_dir)
        try:
            raw = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise BertConfigError(f"cannot read {model_dir}/config.json: {exc}") from exc
        if raw.get("model_type") != "bert":
            raise BertConfigError(f"model_type {raw.get('model_type')!r} is not supported "
                                  "by the embedder (only bert)")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise BertConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise BertConfigError("only absolute position embeddings are supported")
        pooling, normalize = _sentence_transformers_head(model_dir)
        cfg = cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                  num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
                  intermediate_size=raw["intermediate_size"],
                  max_position_embeddings=raw["max_position_embeddings"],
                  type_vocab_size=raw.get("type_vocab_size", 2),
                  layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
                  pooling=pooling, normalize=normalize)
        if cfg.hidden_size % cfg.num_heads:
            raise BertConfigError("hidden_size is not a multiple of num_attention_heads")
        return cfg


def _sentence_transformers_head(model_dir: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) from modules.json and the Pooling module's config.

    A plain BERT directory without them gets mean pooling + L2 normalisation, the
    common choice for sentence embeddings."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except OSError:
        return "mean", True
    except ValueError as exc:
        raise BertConfigError(f"modules.json is not valid JSON: {exc}") from exc
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unknown = set(types) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise BertConfigError(f"unsupported sentence-transformers modules: {sorted(unknown)}")
    pooling = "mean"
    if "Pooling" in types:
        try:
            pool = json.loads((model_dir / types["Pooling"].get("path", "") / "config.json")
                              .read_text())
        except (OSError, ValueError) as exc:
            raise BertConfigError(f"cannot read the Pooling config: {exc}") from exc
        modes = [k for k, v in pool.items() if k.startswith("pooling_mode_") and v is True]
        if modes == ["pooling_mode_mean_tokens"]:
            pooling = "mean"
        elif modes == ["pooling_mode_cls_token"]:
            pooling = "cls"
        else:
            raise BertConfigError(f"unsupported pooling {modes}")
    return pooling, "Normalize" in types


@dataclass
class LayerWeights:
    qkv: torch.Tensor          # [3H, H]: query, key, value fused into one matmul
    qkv_bias: torch.Tensor     # [3H]
    attn_out: torch.Tensor     # [H, H]
    attn_out_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]   # LayerNorm weight, bias [H]
    up: torch.Tensor           # [I, H]
    up_bias: torch.Tensor
    down: torch.Tensor         # [H, I]
    down_bias: torch.Tensor
    out_norm: tuple[torch.Tensor, torch.Tensor]


class BertEncoder:
    def __init__(self, cfg: BertConfig, word: torch.Tensor, position: torch.Tensor,
                 token_type: torch.Tensor, embed_norm: tuple[torch.Tensor, torch.Tensor],
                 layers: list[LayerWeights]) -> None:
        self.cfg = cfg
        self.word, self.position, self.embed_norm, self.layers = word, position, embed_norm, layers
        # Every input is one segment (token type 0): fold its embedding into the positions.
        self.position_and_type = position + token_type[0]    # [max_pos, H]

    @property
    def device(self) -> torch.device:
        return self.word.device

    @property
    def dtype(self) -> torch.dtype:
        return self.word.dtype

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), norm[0], norm[1], self.cfg.layer_norm_eps)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids, mask: [B, T] (mask True on real tokens) -> last hidden states [B, T, H]."""
        cfg = self.cfg
        B, T = input_ids.shape
        nh, hd = cfg.num_heads, cfg.head_dim
        x = self._norm(self.word[input_ids] + self.position_and_type[:T], self.embed_norm)
        # Keys that are padding get no attention weight: [B, 1, 1, T] broadcast over heads
        # and queries. Padded query rows still attend to the real keys (never all-masked).
        attn_mask = mask[:, None, None, :]
        for lw in self.layers:
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)                      # [B, T, 3H]
            q, k, v = qkv.view(B, T, 3, nh, hd).permute(2, 0, 3, 1, 4)  # each [B, nh, T, hd]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            a = a.transpose(1, 2).reshape(B, T, cfg.hidden_size)
            x = self._norm(F.linear(a, lw.attn_out, lw.attn_out_bias) + x, lw.attn_norm)
            h = F.gelu(F.linear(x, lw.up, lw.up_bias))                  # [B, T, I], erf GELU
            x = self._norm(F.linear(h, lw.down, lw.down_bias) + x, lw.out_norm)
        return x

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids, mask: [B, T] -> sentence embeddings [B, H] in float32."""
        hidden = self.hidden_states(input_ids, mask).float()
        if self.cfg.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).float()                              # [B, T, 1]
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1) if self.cfg.normalize else pooled


def _weight_file(model_dir: Path) -> Path:
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise BertConfigError(f"no model.safetensors in {model_dir} (only single-file "
                              "safetensors checkpoints are supported)")
    return path


def load_bert(model_dir: str | Path, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> BertEncoder:
    model_dir = Path(model_dir)
    cfg = BertConfig.from_dir(model_dir)
    device = torch.device(device)
    H, I = cfg.hidden_size, cfg.intermediate_size
    with safe_open(str(_weight_file(model_dir)), framework="pt", device="cpu") as f:
        names = set(f.keys())
        # sentence-transformers saves the bare BertModel; a BertForX checkpoint prefixes "bert.".
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in names else ""

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            full = prefix + name
            if full not in names:
                raise BertConfigError(f"weight {full!r} missing from the checkpoint")
            t = f.get_tensor(full)
            if tuple(t.shape) != shape:
                raise BertConfigError(f"{full}: expected shape {shape}, got {tuple(t.shape)}")
            return t.to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(f"{name}.weight", (H,)), get(f"{name}.bias", (H,))

        layers = []
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            s = p + "attention.self."
            layers.append(LayerWeights(
                qkv=torch.cat([get(s + n + ".weight", (H, H)) for n in ("query", "key", "value")]),
                qkv_bias=torch.cat([get(s + n + ".bias", (H,)) for n in ("query", "key", "value")]),
                attn_out=get(p + "attention.output.dense.weight", (H, H)),
                attn_out_bias=get(p + "attention.output.dense.bias", (H,)),
                attn_norm=norm(p + "attention.output.LayerNorm"),
                up=get(p + "intermediate.dense.weight", (I, H)),
                up_bias=get(p + "intermediate.dense.bias", (I,)),
                down=get(p + "output.dense.weight", (H, I)),
                down_bias=get(p + "output.dense.bias", (H,)),
                out_norm=norm(p + "output.LayerNorm"),
            ))
        return BertEncoder(
            cfg,
            word=get("embeddings.word_embeddings.weight", (cfg.vocab_size, H)),
            position=get("embeddings.position_embeddings.weight", (cfg.max_position_embeddings, H)),
            token_type=get("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, H)),
            embed_norm=norm("embeddings.LayerNorm"),
            layers=layers,
        )
