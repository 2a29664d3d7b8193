"""Decode attention over two KV cache layouts, side by side on one GPU (issue 19: "a KV layout
that reads whole blocks per head contiguously").

- slot-major (today's): one layer's cache is [2, NB, BS, kvh, d]; a head's 16 keys of a block sit
  kvh * d elements apart (128 B of fp8 every 1 KiB).
- head-major: stored as [2, NB, kvh, BS, d] and handed to the same kernel as the transposed view
  [2, NB, BS, kvh, d] (the kernel takes the cache's strides), so a head's block is one run of
  BS * d elements (2 KiB of fp8).

For each cache dtype (bf16, fp8) and decode batch (1, 64, 256 sequences at context 1,536,
Llama-3-8B heads, random block tables), the kernel's default tiles on both layouts and a small
tile sweep on the head-major one; outputs of the two layouts must be identical. The floor is the
K/V bytes the step must read at the copy bandwidth measured in the same run (a device-to-device
copy: read + write bytes over its time).

  python3 bench/gpu_attn_layout.py --out $OUT/gpu_attn_layout.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from services.worker.kernels.attention import decode_splits, paged_attention  # noqa: E402

NH, KVH, D, BS, CTX = 32, 8, 128, 16, 1536


def copy_bandwidth() -> float:
    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median")
    del x, y
    return 2 * (1 << 31) / (ms * 1e-3)


def inputs(batch: int, dtype, head_major: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-CTX // BS)
    nb = batch * per_seq + 8
    base = torch.randn(2, nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if head_major:   # the same values, stored head-major
        store = base.transpose(2, 3).contiguous()              # [2, NB, kvh, BS, d]
        cache = store.to(dtype).transpose(2, 3)                # logical [2, NB, BS, kvh, d]
    else:
        cache = base.to(dtype)
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    tables = perm[:batch * per_seq].view(batch, per_seq).contiguous()
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), CTX, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, NH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, tables, qsl, lens


def timed(q, cache, tables, qsl, lens, cfg) -> float | None:
    try:
        return triton.testing.do_bench(lambda: paged_attention(q, cache, tables, qsl, lens, 1, D ** -0.5, **cfg),
                                       warmup=10, rep=60, return_mode="median")
    except Exception:  # noqa: BLE001 - e.g. out of shared memory for a tile
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_attn_layout.json")
    p.add_argument("--batches", default="1,64,256")
    a = p.parse_args()
    bw = copy_bandwidth()
    out: dict = {"bench": "gpu_attn_layout", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "copy_bytes_per_s": bw, "rows": []}
    for dtype, batch in itertools.product((torch.bfloat16, torch.float8_e4m3fn), (int(b) for b in a.batches.split(","))):
        splits = decode_splits(batch, KVH)
        kv_bytes = 2 * batch * CTX * KVH * D * dtype.itemsize
        floor_ms = kv_bytes / bw * 1e3
        results, outs = {}, {}
        for layout in ("slot", "head"):
            args = inputs(batch, dtype, layout == "head")
            outs[layout] = paged_attention(*args, 1, D ** -0.5, num_splits=splits).float()
            results[f"{layout}_default"] = timed(*args, {"num_splits": splits})
            if layout == "head":
                for n, w, st in ((64, 2, 3), (64, 2, 6), (64, 4, 3), (64, 4, 6), (128, 4, 3), (128, 4, 4), (32, 2, 6)):
                    results[f"head_n{n}_w{w}_s{st}"] = timed(*args, {"num_splits": splits, "block_n": n,
                                                                    "num_warps": w, "num_stages": st})
                for sp in sorted({max(1, splits // 2), splits * 2}):
                    if sp <= 32:
                        results[f"head_default_splits{sp}"] = timed(*args, {"num_splits": sp})
            del args
            torch.cuda.empty_cache()
        ok = {k: v for k, v in results.items() if v is not None}
        best = min(ok, key=ok.get)
        row = {"kv_dtype": str(dtype).replace("torch.", ""), "batch": batch, "splits": splits,
               "floor_ms": floor_ms, "identical_outputs": bool(torch.equal(outs["slot"], outs["head"])),
               "slot_default_ms": results["slot_default"], "head_default_ms": results["head_default"],
               "head_best": best, "head_best_ms": ok[best],
               "slot_default_over_floor": results["slot_default"] / floor_ms,
               "head_best_over_floor": ok[best] / floor_ms,
               "all_ms": results}
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all_ms"}), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0 if all(r["identical_outputs"] for r in out["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
