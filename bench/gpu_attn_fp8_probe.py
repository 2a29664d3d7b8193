"""Where an fp8-cache decode attention step's time goes (issue 19: the served kernel reads an fp8
cache at ~0.7 of its byte floor while it reads a bf16 cache at the floor). A decode-only copy of
kernels/attention.py's program (one token x G heads per program, one KV head, no splits),
timed with parts switched off or changed, on one GPU:

- served: the served paged_attention (the reference for values and time);
- copy: this file's kernel as served (must equal the served output);
- no_qk / no_pv: one of the two dots replaced by a stand-in of the same loads (timing only);
- load_only: both loads, a sum instead of the dots (timing only);
- v_t: V stored transposed per block and head ([d, BS] runs), so the p.V dot's B operand is
  K-major like K's (must equal the served output);
- bf16 cache: the served kernel over a bf16 cache (twice the bytes);
- --fp8-dots: q.k and/or p.v on the FP8 tensor cores (q quantised per row, p scaled by 448), so
  no K/V tile is widened to fp16; reports the extra error against the served output.

  python3 bench/gpu_attn_fp8_probe.py --out $OUT/gpu_attn_fp8_probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from services.worker.kernels.attention import paged_attention  # noqa: E402

NH, KVH, D, BS, CTX = 32, 8, 128, 16, 1536
LOG2E = 1.4426950408889634


@triton.jit
def _probe_kernel(q_ptr, o_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, sm_scale_log2, stride_q,
                  s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_vd, stride_bt,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  BS: tl.constexpr, MODE: tl.constexpr, V_T: tl.constexpr,
                  QK8: tl.constexpr = False, PV8: tl.constexpr = False):
    # MODE 0: as served; 1: no q.k dot; 2: no p.v dot; 3: loads only.
    # QK8: q quantised per row to e4m3 (amax -> 448) and q.k on the FP8 tensor cores (no K widening);
    # PV8: p scaled by 448 to e4m3 and p.v on the FP8 tensor cores (no V widening).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    head = kvh * G + rows % G
    row_ok = rows < G
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + seq * stride_q + head[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    if QK8:
        q32 = q.to(tl.float32)
        q_sc = tl.maximum(tl.max(tl.abs(q32), 1), 1e-12) / 448.0                     # [BLOCK_M]
        q = (q32 / q_sc[:, None]).to(k_ptr.dtype.element_ty)
        row_sc = q_sc * sm_scale_log2
    else:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, ctx, BLOCK_N):
        k_pos = start + cols
        k_ok = k_pos < ctx
        blk = tl.load(bt_ptr + seq * stride_bt + k_pos // BS, mask=k_ok, other=0).to(tl.int64)
        k_off = (blk * s_kb + (k_pos % BS) * s_ks + kvh * s_kh)[:, None] + dims[None, :]
        k = tl.load(k_ptr + k_off, mask=k_ok[:, None], other=0.0)                         # [N, D]
        if not QK8:
            k = k.to(tl.float16)
        if V_T:
            v_off = (blk * s_vb + (k_pos % BS) * s_vs + kvh * s_vh)[None, :] + dims[:, None] * s_vd
            vt = tl.load(v_ptr + v_off, mask=k_ok[None, :], other=0.0)                    # [D, N]
            if not PV8:
                vt = vt.to(tl.float16)
        else:
            v_off = (blk * s_vb + (k_pos % BS) * s_vs + kvh * s_vh)[:, None] + dims[None, :]
            v = tl.load(v_ptr + v_off, mask=k_ok[:, None], other=0.0)                     # [N, D]
            if not PV8:
                v = v.to(tl.float16)
        if MODE == 1 or MODE == 3:
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + tl.sum(k.to(tl.float32), 1)[None, :] * 1e-9
        elif QK8:
            s = tl.dot(q, tl.trans(k)) * row_sc[:, None]
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale_log2
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 2 or MODE == 3:
            if V_T:
                acc = acc * alpha[:, None] + tl.sum(vt.to(tl.float32), 1)[None, :]
            else:
                acc = acc * alpha[:, None] + tl.sum(v.to(tl.float32), 0)[None, :]
        elif PV8:
            p8 = (p * 448.0).to(v_ptr.dtype.element_ty)
            if V_T:
                acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt)) * (1.0 / 448.0)
            else:
                acc = acc * alpha[:, None] + tl.dot(p8, v) * (1.0 / 448.0)
        else:
            if V_T:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.trans(vt)).to(tl.float32)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(o_ptr + seq * stride_q + head[:, None] * D + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def probe(q, kc, vc, tables, lens, mode: int, v_t: bool, warps: int, stages: int, block_n: int = 64,
          qk8: bool = False, pv8: bool = False):
    out = torch.empty_like(q)
    b = q.shape[0]
    _probe_kernel[(b, KVH)](q, out, kc, vc, tables, lens, D ** -0.5 * LOG2E, q.stride(0),
                            kc.stride(0), kc.stride(1), kc.stride(2),
                            vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3), tables.stride(0),
                            G=NH // KVH, BLOCK_M=16, BLOCK_N=block_n, D=D, BS=BS, MODE=mode, V_T=v_t,
                            QK8=qk8, PV8=pv8, num_warps=warps, num_stages=stages)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_attn_fp8_probe.json")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--fp8-dots", action="store_true", help="only the served kernels and the FP8-dot variants")
    a = p.parse_args()
    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * (1 << 31) / (triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3)
    del x, y
    g = torch.Generator(device="cuda").manual_seed(0)
    b = a.batch
    per = CTX // BS
    nb = b * per + 8
    base = torch.randn(2, nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cache8 = base.to(torch.float8_e4m3fn)
    cache16 = base
    vt_store = cache8[1].permute(0, 2, 3, 1).contiguous()          # [NB, kvh, d, BS]
    vt_view = vt_store.permute(0, 3, 1, 2)                          # logical [NB, BS, kvh, d]
    tables = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)[:b * per].view(b, per).contiguous()
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), CTX, device="cuda", dtype=torch.int32)
    q = torch.randn(b, NH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    floor_ms = 2 * b * CTX * KVH * D / bw * 1e3
    res: dict = {"bench": "gpu_attn_fp8_probe", "device": torch.cuda.get_device_name(), "triton": triton.__version__,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "batch": b, "context": CTX,
                 "copy_bytes_per_s": bw, "fp8_floor_ms": floor_ms, "runs": {}}

    def bench(name, fn, check=None):
        try:
            o = fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")
            row = {"ms": ms, "over_fp8_floor": ms / floor_ms}
            if check is not None:
                row["max_abs_diff_vs_served"] = float((o.float() - check.float()).abs().max())
                row["rel_l2_vs_served"] = float((o.float() - check.float()).norm() / check.float().norm())
        except Exception as exc:  # noqa: BLE001
            row = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        res["runs"][name] = row
        print(name, row, flush=True)
    served = paged_attention(q, cache8, tables, qsl, lens, 1, D ** -0.5)
    bench("served_fp8", lambda: paged_attention(q, cache8, tables, qsl, lens, 1, D ** -0.5))
    bench("served_bf16_cache", lambda: paged_attention(q, cache16, tables, qsl, lens, 1, D ** -0.5))
    if a.fp8_dots:
        # The served fp8 kernel's own error against the bf16 cache it was quantised from, for scale.
        bench("served_fp8_vs_bf16_cache", lambda: paged_attention(q, cache8, tables, qsl, lens, 1, D ** -0.5),
              paged_attention(q, cache16, tables, qsl, lens, 1, D ** -0.5))
        for w, st in ((2, 3), (2, 6), (4, 3)):
            for qk8, pv8, vt in ((True, False, False), (False, True, False), (True, True, False), (True, True, True)):
                name = f"{'qk8_' if qk8 else ''}{'pv8_' if pv8 else ''}{'vt_' if vt else ''}w{w}_s{st}"
                bench(name, lambda: probe(q, cache8[0], vt_view if vt else cache8[1], tables, lens, 0, vt, w, st,
                                          qk8=qk8, pv8=pv8), served)
    for w, st in (() if a.fp8_dots else ((2, 6), (4, 4), (2, 3))):
        for mode, name in ((0, "copy"), (1, "no_qk"), (2, "no_pv"), (3, "load_only")):
            bench(f"{name}_w{w}_s{st}", lambda: probe(q, cache8[0], cache8[1], tables, lens, mode, False, w, st),
                  served if mode == 0 else None)
        bench(f"v_t_w{w}_s{st}", lambda: probe(q, cache8[0], vt_view, tables, lens, 0, True, w, st), served)
        bench(f"v_t_no_pv_w{w}_s{st}", lambda: probe(q, cache8[0], vt_view, tables, lens, 2, True, w, st))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
