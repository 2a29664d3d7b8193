"""How close the fp8 decode attention gets to what the GPU can read (issue 19: at 512 rows the
decode step's attention is ~60% of its time). One GPU, one run, at 256 and 512 rows of a
1,536-token context (Llama-3-8B heads: 32 query heads, 8 KV heads, d 128):

- ceilings: a copy (read + write), a streaming read of one large buffer, and a gather read of
  exactly the bytes the attention reads (each sequence's K rows and transposed V blocks through
  its block table, no arithmetic): the attention kernel cannot beat the last;
- served: kernels/attention.paged_attention as served, then with the grid launched heads first
  (GRID_HEADS_FIRST: a sequence's 8 KV heads side by side), a tile sweep (keys per tile, warps,
  stages), and caches of 32- and 64-token blocks (fewer, longer runs per head);
- tma: a decode-only kernel with one cache block per key tile brought in by the TMA (tensor
  descriptors: one load per K and V tile, no per-thread addresses), for 32- and 64-token blocks.

Every variant's output is compared with the served one (max abs diff).

  python3 bench/gpu_attn_decode_probe.py --out $OUT/gpu_attn_decode_probe.json
  ncu --profile-from-start off --section SpeedOfLight ... python3 bench/gpu_attn_decode_probe.py --ncu
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from gpu_fp8_vt_probe import profile_once  # noqa: E402
from services.worker.kernels import attention as ka  # noqa: E402

NH, KVH, D, CTX = 32, 8, 128, 1536
TILES = [(64, 2, 6), (64, 2, 4), (64, 2, 8), (64, 4, 4), (64, 4, 6), (32, 2, 6), (32, 4, 6), (128, 2, 3),
         (128, 4, 3), (128, 4, 4)]          # (keys per tile, warps, stages); the first is the served default


@triton.jit
def _seq_and_head(HEADS_FIRST: tl.constexpr):
    """This program's (sequence, KV head) on a (kvh, seqs) grid, or a (seqs, kvh) one."""
    if HEADS_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        acc ^= tl.load(x_ptr + base + i * BLOCK + offs)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


@triton.jit
def _gather_read_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, s_cb, s_cs, s_ch, s_bt,
                        BS: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """The decode attention's reads with int32 words (K: a 128-byte row per key; V: a head's
    transposed block, 128 * BS bytes), xor-folded so nothing is optimised away."""
    seq, kvh = _seq_and_head(HEADS_FIRST)
    ctx = tl.load(lens_ptr + seq)
    cols = tl.arange(0, BLOCK_N)
    w = tl.arange(0, 32)
    NBLK: tl.constexpr = BLOCK_N // BS
    jb = tl.arange(0, NBLK)
    vw = tl.arange(0, 32 * BS)
    acc_k = tl.zeros([BLOCK_N, 32], tl.int32)
    acc_v = tl.zeros([NBLK, 32 * BS], tl.int32)
    for start in range(0, ctx, BLOCK_N):
        kp = start + cols
        blk = tl.load(bt_ptr + seq * s_bt + kp // BS, mask=kp < ctx, other=0).to(tl.int64)
        k = tl.load(k_ptr + (blk * s_cb + (kp % BS) * s_cs + kvh * s_ch)[:, None] + w[None, :],
                    mask=(kp < ctx)[:, None], other=0)
        bp = start + jb * BS
        vblk = tl.load(bt_ptr + seq * s_bt + bp // BS, mask=bp < ctx, other=0).to(tl.int64)
        v = tl.load(v_ptr + (vblk * s_cb + kvh * (32 * BS))[:, None] + vw[None, :], mask=(bp < ctx)[:, None], other=0)
        acc_k ^= k
        acc_v ^= v
    tl.store(out_ptr + seq * 8 + kvh, tl.xor_sum(tl.xor_sum(acc_k, 1), 0) ^ tl.xor_sum(tl.xor_sum(acc_v, 1), 0))


@triton.jit
def _tma_decode_kernel(q_ptr, o_ptr, k_desc, v_desc, bt_ptr, lens_ptr, sm_scale_log2, stride_qt, stride_qh,
                       stride_ot, stride_oh, s_bt, G: tl.constexpr, BLOCK_M: tl.constexpr, BS: tl.constexpr,
                       D: tl.constexpr, KVH: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """Decode attention over an fp8 cache with V transposed per block, one cache block per key
    tile, K and V brought in by the TMA (one descriptor load each, no per-thread addresses):
    K rows [BS, D] at (block * BS, kvh * D) of the cache as [slots, kvh * d]; V [D, BS] at
    ((block * kvh_count + kvh) * D, 0) of V as [blocks * kvh * d, BS]."""
    seq, kvh = _seq_and_head(HEADS_FIRST)
    ctx = tl.load(lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    head = kvh * G + rows % G
    row_ok = rows < G
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    cols = tl.arange(0, BS)
    for j in range(tl.cdiv(ctx, BS)):
        blk = tl.load(bt_ptr + seq * s_bt + j)
        k = k_desc.load([blk * BS, kvh * D]).to(tl.float16)                 # [BS, D]
        vt = v_desc.load([(blk * KVH + kvh) * D, 0]).to(tl.float16)         # [D, BS]
        s = tl.dot(q, tl.trans(k)) * sm_scale_log2
        s = tl.where((j * BS + cols < ctx)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.trans(vt))
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(o_ptr + seq * stride_ot + head[:, None] * stride_oh + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def tma_decode(q, cache, tables, lens, heads_first: bool, warps: int, stages: int, out=None):
    """_tma_decode_kernel over a contiguous fp8 cache [2, NB, BS, kvh, d] with V transposed."""
    b, nh, d = q.shape
    _, nb, bs, kvh, _ = cache.shape
    out = torch.empty_like(q) if out is None else out
    k2 = cache[0].view(nb * bs, kvh * d)
    v2 = cache[1].view(nb * kvh * d, bs)
    k_desc = TensorDescriptor(k2, list(k2.shape), [kvh * d, 1], [bs, d])
    v_desc = TensorDescriptor(v2, list(v2.shape), [bs, 1], [d, bs])
    g = nh // kvh
    grid = (kvh, b) if heads_first else (b, kvh)
    _tma_decode_kernel[grid](q, out, k_desc, v_desc, tables, lens, d ** -0.5 * 1.4426950408889634,
                             q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
                             G=g, BLOCK_M=max(16, triton.next_power_of_2(g)), BS=bs, D=d, KVH=kvh,
                             HEADS_FIRST=heads_first, num_warps=warps, num_stages=stages)
    return out


def attn_inputs(b: int, bs: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = -(-CTX // bs)
    nb = b * per + 8
    cache = torch.empty(2, nb, bs, KVH, D, device="cuda", dtype=torch.float8_e4m3fn)
    for i in range(0, nb, 4096):      # random finite bytes, in slices (little scratch)
        part = cache[:, i:i + 4096]
        part.copy_(torch.randn(part.shape, device="cuda", dtype=torch.bfloat16, generator=g))
    tables = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)[:b * per].view(b, per).contiguous()
    lens = torch.full((b,), CTX, device="cuda", dtype=torch.int32)
    q = torch.randn(b, NH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    return cache, tables, lens, q, qsl


def served(q, cache, tables, qsl, lens, heads_first: bool = False, **kw):
    before = ka.GRID_HEADS_FIRST
    ka.GRID_HEADS_FIRST = heads_first
    try:
        return ka.paged_attention(q, cache, tables, qsl, lens, 1, D ** -0.5,
                                  num_splits=ka.decode_splits(q.shape[0], KVH), **kw)
    finally:
        ka.GRID_HEADS_FIRST = before


def gather_read(cache, tables, lens, heads_first: bool, block_n: int, warps: int, stages: int, out):
    b, bs = tables.shape[0], cache.shape[2]
    words = cache.view(torch.int32)                        # [2, NB, BS, kvh, 32]
    kc, vc = words[0], words[1]
    grid = (KVH, b) if heads_first else (b, KVH)
    _gather_read_kernel[grid](kc, vc, tables, lens, out, kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0),
                              BS=bs, BLOCK_N=max(block_n, bs), HEADS_FIRST=heads_first, num_warps=warps,
                              num_stages=stages)
    return out


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def ceilings() -> dict:
    n = 1 << 30                                            # 4 GiB of int32
    x = torch.empty(n, dtype=torch.int32, device="cuda")
    y = torch.empty_like(x)
    copy_bw = 2 * 4 * n / (timed(lambda: y.copy_(x)) * 1e-3)
    del y
    best = {}
    for block, iters, warps in ((2048, 8, 4), (4096, 8, 8), (2048, 16, 4), (1024, 16, 4)):
        out = torch.empty(n // (block * iters), dtype=torch.int32, device="cuda")
        ms = timed(lambda: _stream_read_kernel[(out.numel(),)](x, out, BLOCK=block, ITERS=iters, num_warps=warps))
        best[f"b{block}_i{iters}_w{warps}"] = 4 * n / (ms * 1e-3)
    del x
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "stream_read_bytes_per_s": max(best.values()), "stream_read_configs": best}


def run(res: dict, batches, block_sizes) -> None:
    for b in batches:
        kv_bytes = 2 * b * CTX * KVH * D
        for bs in block_sizes:
            cache, tables, lens, q, qsl = attn_inputs(b, bs)
            want = served(q, cache, tables, qsl, lens)
            rows: dict = {"kv_bytes": kv_bytes}
            out = torch.empty(b * 8, dtype=torch.int32, device="cuda")

            def rec(name, fn, check=True):
                try:
                    o = fn()
                    ms = timed(fn)
                    row = {"ms": ms, "TBps": kv_bytes / (ms * 1e-3) / 1e12}
                    if check:
                        row["max_abs_diff_vs_served"] = float((o.float() - want.float()).abs().max())
                except Exception as exc:  # noqa: BLE001 - a config that cannot compile is a result
                    row = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                rows[name] = row
                print(f"b{b} bs{bs}", name, row, flush=True)

            for hf in (False, True):
                for bn, w, st in ((64, 2, 6), (64, 4, 4), (128, 4, 3)):
                    rec(f"gather_read{'_hf' if hf else ''}_n{bn}_w{w}_s{st}",
                        lambda: gather_read(cache, tables, lens, hf, bn, w, st, out), check=False)
            rec("served", lambda: served(q, cache, tables, qsl, lens))
            rec("served_heads_first", lambda: served(q, cache, tables, qsl, lens, True))
            for bn, w, st in TILES:
                if bn < bs:
                    continue
                for hf in (False, True):
                    rec(f"served{'_hf' if hf else ''}_n{bn}_w{w}_s{st}",
                        lambda: served(q, cache, tables, qsl, lens, hf, block_n=bn, num_warps=w, num_stages=st))
            if bs >= 32:
                for hf in (False, True):
                    for w, st in ((2, 4), (2, 6), (4, 4)):
                        rec(f"tma{'_hf' if hf else ''}_w{w}_s{st}", lambda: tma_decode(q, cache, tables, lens, hf, w, st))
            res["decode"][f"b{b}_bs{bs}"] = rows
            del cache, tables
            torch.cuda.empty_cache()


def run_ncu() -> None:
    """The served kernel at 512 rows (both grid orders) and the gather read, once each after a
    warm-up, between cudaProfilerStart/Stop."""
    cache, tables, lens, q, qsl = attn_inputs(512, 16)
    out = torch.empty(512 * 8, dtype=torch.int32, device="cuda")
    fns = [lambda: served(q, cache, tables, qsl, lens), lambda: served(q, cache, tables, qsl, lens, True),
           lambda: gather_read(cache, tables, lens, False, 64, 2, 6, out)]
    profile_once(fns)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gpu_attn_decode_probe.json")
    p.add_argument("--batches", default="512,256")
    p.add_argument("--block-sizes", default="16,32,64")
    p.add_argument("--ncu", action="store_true", help="run three kernels once in a profiled range, time nothing")
    a = p.parse_args()
    if a.ncu:
        run_ncu()
        return 0
    res: dict = {"bench": "gpu_attn_decode_probe", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "context": CTX}
    res["ceilings"] = ceilings()
    print("ceilings", res["ceilings"], flush=True)
    res["decode"] = {}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        run(res, [int(x) for x in a.batches.split(",")], [int(x) for x in a.block_sizes.split(",")])
    finally:
        out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
