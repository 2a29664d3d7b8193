"""SiLU·mul with a per-token FP8 output (kernels/elementwise.silu_mul, fp8_out: the gate_up
product's consumer at 2+ rows), timed on one GPU over (BLOCK, warps): the served chunks of 2,048
(the row walked twice, its maximum then its values) against the row held whole in one pass.
In a b256 decode step of the 8B shape it took 0.72 ms of 13.9 (H200 profile,
bench/results/gpu_fp8_probe.json) for ~18 MB of traffic per layer, ~5x its byte floor.

  python3 bench/gpu_silu_sweep.py --out $OUT/gpu_silu_sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from services.worker.kernels import elementwise as ke  # noqa: E402

CONFIGS = [(2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 16), (16384, 16), (16384, 32)]
WIDTH = 14336


def main() -> int:
    from gpu_fp8_kernels import copy_bw, graph_us
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_silu_sweep.json")
    a = p.parse_args()
    bw = copy_bw()
    res: dict = {"bench": "gpu_silu_sweep", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "copy_bytes_per_s": bw, "rows": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (64, 256):
        copies = 8
        xs = [torch.randn(t, 2 * WIDTH, device="cuda", generator=g).to(torch.bfloat16) for _ in range(copies)]
        rs = torch.rand(t, 1, device="cuda", generator=g) + 0.5
        cs = torch.rand(2 * WIDTH, device="cuda", generator=g) + 0.5
        floor_us = (t * 2 * WIDTH * 2 + t * WIDTH) / bw * 1e6
        ref_q, ref_s = ke.silu_mul(xs[0], in_scales=(rs, cs), fp8_out=True, fp8_config=CONFIGS[0])
        rows = {"floor_us": floor_us}
        for cfg in CONFIGS:
            try:
                q, s = ke.silu_mul(xs[0], in_scales=(rs, cs), fp8_out=True, fp8_config=cfg)
                same = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s))
                us = graph_us([lambda x=x, cfg=cfg: ke.silu_mul(x, in_scales=(rs, cs), fp8_out=True, fp8_config=cfg)
                               for x in xs])
                rows[f"{cfg[0]}x{cfg[1]}"] = {"us": us, "over_floor": us / floor_us, "equal_to_served": same}
            except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run is a result
                rows[f"{cfg[0]}x{cfg[1]}"] = {"error": repr(exc)[:200]}
            print(t, cfg, rows[f"{cfg[0]}x{cfg[1]}"], flush=True)
        res["rows"][str(t)] = rows
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
