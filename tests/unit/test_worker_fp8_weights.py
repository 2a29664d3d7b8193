"""FP8 weights (--quantization fp8; services/worker/models/fp8.py, kernels/fp8.py) on the CPU:
per-channel scales, the reference forward on the dequantised FP8 values, FP8 checkpoints loaded
as stored (HF fp8 per-tensor, weight_scale_inv, compressed-tensors per-channel), the refusals,
tensor-parallel shards, and the Triton kernels under the interpreter (the quantiser equal to
torch's e4m3 cast; the GEMV against the dequantised product)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is imported

from services.worker.attention import SeqSchedule, build_attn_metadata  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.models.config import ModelConfigError  # noqa: E402
from services.worker.models.fp8 import FP8, Fp8Weight, quantize_weight  # noqa: E402
from tests.unit.tiny_llama import make_tiny_llama  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-fp8"), seed=11)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    kv = [torch.zeros(model.kv_cache_shape(8, 16), dtype=model.dtype) for _ in model.layers]
    meta = build_attn_metadata([SeqSchedule([0, 1, 2, 3], 0, len(ids))], 16, model.device)
    h = model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, kv)
    return model.compute_logits(h[-1:])[0]


def test_per_channel_scales_and_the_dequantised_error():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]     # rows of very different ranges
    w[5] = 0
    q = quantize_weight(w)
    assert q.weight.dtype == FP8 and q.scale.dtype == torch.float32
    assert torch.equal(q.scale[5], torch.tensor(1.0)), "an all-zero row gets scale 1"
    amax = w.abs().amax(1)
    assert torch.allclose(q.scale[amax > 0], amax[amax > 0] / 448)
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= w.abs() * 2 ** -4 + amax[:, None] / 448 * 2 ** -9 + 1e-12).all(), "e4m3: 3 mantissa bits"


def test_quantised_model_runs_the_fp8_values_and_stays_close_to_the_original(tiny):
    ref = load_model(tiny)
    fp8 = load_model(tiny, quantization="fp8")
    assert all(isinstance(getattr(lw, n), Fp8Weight) for lw in fp8.layers for n in ("qkv", "o", "gate_up", "down"))
    assert fp8.lm_head.dtype == torch.float32 and fp8.embed.dtype == torch.float32, "embedding and lm_head stay"
    ids = [5, 17, 33, 2, 61, 8, 40]
    a, b = last_logits(ref, ids), last_logits(fp8, ids)
    assert not torch.equal(a, b), "the FP8 values are what runs"
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    assert (a - b).norm() < 0.1 * a.norm()


def _fp8_checkpoint(src, dst, style: str) -> None:
    """Rewrite the tiny checkpoint with FP8 projections as quantisers store them."""
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            q = quantize_weight(tensors[name])
            base = name[:-len(".weight")]
            tensors[name] = q.weight
            if style == "channel":       # compressed-tensors, strategy channel: [N, 1]
                tensors[base + ".weight_scale"] = q.scale[:, None].clone()
            elif style == "inverse":     # weight_scale_inv holds 1 / scale
                tensors[base + ".weight_scale_inv"] = (1.0 / q.scale).clone()
            else:                        # per tensor: one scale for the whole weight
                s = q.scale.max()
                tensors[name] = (q.dequantize(torch.float32) / s).clamp(-448, 448).to(FP8)
                tensors[base + ".weight_scale"] = s.reshape(())
    if style == "channel":
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}, "targets": ["Linear"]}}}
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("style", ["channel", "inverse", "tensor"])
def test_fp8_checkpoints_load_as_stored(tiny, tmp_path, style):
    _fp8_checkpoint(tiny, tmp_path / style, style)
    model = load_model(tmp_path / style)                      # no --quantization needed
    stored = load_file(str(tmp_path / style / "model.safetensors"))
    qkv = model.layers[0].qkv
    assert isinstance(qkv, Fp8Weight)
    want = torch.cat([stored[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.weight.view(torch.uint8), want.view(torch.uint8)), "the stored bytes, not re-quantised"
    down = model.layers[1].down
    raw, key = stored["model.layers.1.mlp.down_proj.weight"], "model.layers.1.mlp.down_proj.weight_scale"
    scale = 1.0 / stored[key + "_inv"] if style == "inverse" else stored[key].reshape(-1)
    assert torch.equal(down.dequantize(torch.float32), raw.float() * (scale[:, None] if scale.numel() > 1 else scale))
    ids = [3, 9, 27, 81, 50]
    if style == "tensor":    # quantised twice (per channel, then per tensor): only close
        a, b = last_logits(model, ids), last_logits(load_model(tiny), ids)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.98
    else:                    # the very values --quantization fp8 makes at load
        close = load_model(tiny, quantization="fp8")
        assert torch.allclose(last_logits(model, ids), last_logits(close, ids), atol=1e-4)


@pytest.mark.parametrize("qcfg, says", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise scales"),
    ({"quant_method": "awq"}, "quantization method 'awq' is not served"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "only 8-bit float weights"),
])
def test_unserved_quantisations_are_refused_by_name(tiny, tmp_path, qcfg, says):
    d = tmp_path / "q"
    d.mkdir()
    (d / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    cfg = json.loads((tiny / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    with pytest.raises(ModelConfigError, match=says):
        load_model(d)
    with pytest.raises(ModelConfigError, match="--quantization must be one of"):
        load_model(tiny, quantization="int4")


def test_tensor_parallel_shards_of_fp8_weights_are_slices_of_the_whole(tiny):
    from services.worker.tp import shard_model
    full = load_model(tiny, quantization="fp8")
    whole = full.layers[0]
    cfg = full.cfg
    nh, kvh, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shards = [shard_model(full, r, 2).layers[0] for r in range(2)]
    qkv = whole.qkv.dequantize(torch.float32)
    q, k, v = qkv.split([nh * d, kvh * d, kvh * d])
    for r, s in enumerate(shards):
        qs, ks = nh // 2 * d, kvh // 2 * d
        want = torch.cat([q[r * qs:(r + 1) * qs], k[r * ks:(r + 1) * ks], v[r * ks:(r + 1) * ks]])
        assert torch.equal(s.qkv.dequantize(torch.float32), want)
        assert torch.equal(s.down.dequantize(torch.float32),
                           whole.down.dequantize(torch.float32)[:, r * inter // 2:(r + 1) * inter // 2])


def test_the_triton_quantiser_matches_torchs_e4m3_cast():
    from services.worker.kernels.fp8 import quantize_rows
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 300, generator=g) * 10 ** torch.randn(9, 1, generator=g)
    x[0, :6] = torch.tensor([0.0, 1e-9, -3e-5, 1.97, 124.3, -5.0])   # carries into the exponent
    x[1] = 0
    q, s = quantize_rows(x)
    amax = x.abs().amax(1)
    assert torch.equal(s[:, 0], torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    # Equal values (a tiny negative that rounds to zero may come out +0 rather than -0): the row
    # times its scale's reciprocal (vLLM's per-token rule), not divided by the scale.
    assert torch.equal(q.float(), (x * (1 / s)).clamp(-448, 448).to(FP8).float())


@pytest.mark.parametrize("reciprocal", [True, False])
def test_the_quantiser_multiplies_by_the_reciprocal_where_that_differs_from_dividing(monkeypatch, reciprocal):
    """Values next to e4m3 rounding ties, where x * (1 / s) and x / s land on either side of the
    tie: the quantiser gives the multiplied one (the rule the GPU and its torch twin share), or the
    divided one when RECIPROCAL_QUANT is off (the A/B switch)."""
    from services.worker.kernels import fp8 as fp8_kernels
    from services.worker.kernels.fp8 import quantize_rows
    monkeypatch.setattr(fp8_kernels, "RECIPROCAL_QUANT", reciprocal)
    ties = torch.tensor([1.0625, 1.1875, 3.25, 13.0, 104.0, 0.0146484375])   # e4m3 midpoints
    for amax in (1.3, 7.7, 200.1, 333.3):
        s = torch.tensor([amax / 448], dtype=torch.float32)
        near = (ties[:, None] * s).repeat(1, 33)                # a few fp32 ulps either side of each tie
        steps = torch.arange(-16, 17, dtype=torch.float32)
        x = (near + steps * torch.finfo(torch.float32).eps * near.abs()).flatten()
        x = torch.cat([torch.tensor([amax]), x])               # the row's maximum: its scale is s
        by_mul = (x * (1 / s)).clamp(-448, 448).to(FP8).float()
        by_div = (x / s).clamp(-448, 448).to(FP8).float()
        if not torch.equal(by_mul, by_div):
            q, scale = quantize_rows(x[None, :])
            assert torch.equal(scale[0], s)
            assert torch.equal(q[0].float(), by_mul if reciprocal else by_div)
            return
    raise AssertionError("no value near a tie rounds differently under the two rules")


def test_the_fp8_gemv_equals_the_dequantised_product():
    from services.worker.kernels.fp8 import fp8_linear
    g = torch.Generator().manual_seed(5)
    w = quantize_weight(torch.randn(70, 200, generator=g))
    x, b = torch.randn(1, 200, generator=g), torch.randn(70, generator=g)
    torch.testing.assert_close(fp8_linear(x, w, b), x @ w.dequantize(torch.float32).t() + b, rtol=1e-5, atol=1e-4)


def test_the_worker_flag_and_the_loader_accept_the_same_quantizations():
    from services.worker.config import QUANTIZATIONS as flag_values
    from services.worker.models.fp8 import QUANTIZATIONS as loader_values
    assert flag_values == loader_values == ("none", "fp8")
