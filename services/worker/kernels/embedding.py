"""Token embedding lookup whose ids may come from the previous step's sampler on the device.

With the host/GPU overlap (runner.py), step N+1 is launched before the host has read the
tokens step N sampled. A decode row's input id is then not known on the host: its `src` entry
names the row of the device buffer the sampler of step N wrote (`prev_tokens`), and this kernel
reads the id from there. Rows with src -1 use the host's id. It replaces the embedding gather,
so resolving ids costs no extra launch inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.pdl import launch_args, wait_prior


@triton.jit
def _embed_kernel(ids_ptr, src_ptr, prev_ptr, table_ptr, out_ptr, hidden, stride_table, stride_out,
                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(src_ptr + t)
    tok = tl.load(ids_ptr + t)
    if src >= 0:
        tok = tl.load(prev_ptr + src)
    ok = cols < hidden
    row = tl.load(table_ptr + tok.to(tl.int64) * stride_table + cols, mask=ok)
    tl.store(out_ptr + t * stride_out + cols, row, mask=ok)


def embed_tokens(table: torch.Tensor, ids: torch.Tensor, src: torch.Tensor,
                 prev_tokens: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """table [V, H]; ids, src [T] long (src >= 0: take prev_tokens[src] instead of ids);
    prev_tokens [S] long -> [T, H] rows of the table."""
    t = ids.shape[0]
    v, h = table.shape
    out = torch.empty(t, h, dtype=table.dtype, device=table.device)
    if t == 0:
        return out
    assert table.stride(1) == 1
    block = min(block, triton.next_power_of_2(h))
    _embed_kernel[(t, triton.cdiv(h, block))](ids, src, prev_tokens, table, out, h, table.stride(0),
                                              out.stride(0), BLOCK=block, num_warps=4, **launch_args(ids))
    return out

