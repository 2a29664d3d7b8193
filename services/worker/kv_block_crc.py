"""CRC-32C of KV blocks on the GPU (docs/kv_tiers.md): the same checksum as the kvstore's
(services/common/kv_blocks.py, the `crc32c` package), computed where the bytes are, so a kvstore
load is verified on the device bytes it landed in and a save's checksums come from the cache's
own bytes, with no CPU thread reading the block memory (the CPU's CRC passes were what held the
tier's bandwidth to a third of a host-to-device copy: they share the host's cores and memory
with the DMAs, and the worker's GIL with its copy loop).

CRC-32C is linear over GF(2): with R(x) the CRC register after x from a zero start,
crc32c(x) = R(x) ^ crc32c(zeros(len(x))), and R(a || b) = A_len(b)(R(a)) ^ R(b), A_n being n zero
bytes of register steps (a 32x32 bit matrix). So a block is cut into SEG-byte segments:

  level 1: R(segment) = XOR over its words i and bits b set of COLS1[i][b]  (one table for all)
  level 2: R(block)   = XOR over segments j and bits b set of R(segment j) of COLS2[j][b]
           (COLS2[j] is A advancing past the segments after j)

One Triton kernel does both (`_gf2_rows`: each row of int32 words against a table of 32
columns per word); the tables are built once per block size with the CPU's crc32c, so the GPU's
answer is the CPU's by construction, and tests compare the two on random bytes.

    crc = BlockCrc.for_size(block_bytes)   # None: no Triton, or a size it does not cut
    crcs = crc(blocks)                     # blocks: [n, block_bytes] uint8 -> [n] int32, same device
"""
from __future__ import annotations

import functools
import logging
import threading

import crc32c
import torch

from services.common.kv_blocks import checksum

log = logging.getLogger("meshllm.worker.kv_block_crc")

_SEG_WORDS = (1024, 512, 256, 128, 64)   # level-1 segment, largest that cuts the block
_MASK = 0xFFFFFFFF

try:   # the CPU path never needs triton (the copying tier then checksums on the CPU)
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no triton: no GPU checksum
    triton = None


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 32) if v >= 1 << 31 else v


def _advance(states: list[int], nbytes: int) -> list[int]:
    """Each CRC register state after `nbytes` zero bytes (crc32c's `value` is the register's
    complement)."""
    zeros = bytes(nbytes)
    return [checksum_from(zeros, s) for s in states]


def checksum_from(data, register: int) -> int:
    """The CRC register after `data`, from `register` (not complemented)."""
    return crc32c.crc32c(data, register ^ _MASK) ^ _MASK


def _tables(block_bytes: int, seg_words: int) -> tuple[list[int], list[int], int]:
    """(COLS1 as [32][seg_words], COLS2 as [32][segments], crc32c(zeros(block_bytes)))."""
    segments = block_bytes // (4 * seg_words)
    units = [1 << b for b in range(32)]
    # COLS1[i][b]: the register after a segment whose only set bit is bit b of word i (bit b of
    # a little-endian int32 word is bit b % 8 of its byte b // 8: one register step per byte).
    last = [checksum_from((1 << b).to_bytes(4, "little"), 0) for b in range(32)]
    cols1 = _columns(last, seg_words, 4)
    cols2 = _columns(units, segments, 4 * seg_words)
    return cols1, cols2, checksum(bytes(block_bytes))


def _columns(col: list[int], n: int, step_bytes: int) -> list[list[int]]:
    """out[b][i]: `col[b]` advanced by (n - 1 - i) * step_bytes zero bytes (the last position
    holds col itself)."""
    out = [[0] * n for _ in range(32)]
    for i in range(n - 1, -1, -1):
        for b in range(32):
            out[b][i] = col[b]
        if i:
            col = _advance(col, step_bytes)
    return out


if triton is not None:
    @triton.jit
    def _xor(a, b):
        return a ^ b

    @triton.jit
    def _gf2_rows(x_ptr, cols_ptr, out_ptr, rows_n, K: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        """out[r] = XOR over k < K and bits b set in x[r, k] of cols[b, k] (int32 everywhere)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < rows_n
        base = rows.to(tl.int64) * K
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kin = ks < K
            w = tl.load(x_ptr + base[:, None] + ks[None, :], mask=live[:, None] & kin[None, :], other=0)
            for b in tl.static_range(32):
                col = tl.load(cols_ptr + b * K + ks, mask=kin, other=0)
                # bit b of w spread over all 32 bits (an arithmetic shift), masking the column
                acc ^= ((w << (31 - b)) >> 31) & col[None, :]
        tl.store(out_ptr + rows, tl.reduce(acc, 1, _xor), mask=live)


class BlockCrc:
    """CRC-32C of [n, block_bytes] uint8 tensors on their device (see the module's docstring)."""

    def __init__(self, block_bytes: int, seg_words: int) -> None:
        self.block_bytes = block_bytes
        self.seg_words = seg_words
        self.segments = block_bytes // (4 * seg_words)
        cols1, cols2, zero_crc = _tables(block_bytes, seg_words)
        self._host = (torch.tensor([_signed(v) for row in cols1 for v in row], dtype=torch.int32),
                      torch.tensor([_signed(v) for row in cols2 for v in row], dtype=torch.int32))
        self._zero = _signed(zero_crc)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def for_size(block_bytes: int) -> "BlockCrc | None":
        """The checksum for blocks of this size, or None: no Triton here, or no level-1 segment
        (1024..64 words) cuts the block."""
        if triton is None or block_bytes % 4:
            return None
        seg = next((s for s in _SEG_WORDS if (block_bytes // 4) % s == 0), None)
        return BlockCrc(block_bytes, seg) if seg is not None else None

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if device not in self._on:
                self._on[device] = tuple(t.to(device) for t in self._host)
            return self._on[device]

    def __call__(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n] int32 CRC-32Cs (as crc32c's unsigned value, & 0xFFFFFFFF) of contiguous uint8
        [n, block_bytes] (or [n, ...] of that many bytes per row) on the current stream."""
        n = blocks.shape[0]
        if blocks.numel() != n * self.block_bytes or blocks.dtype != torch.uint8:
            raise ValueError(f"BlockCrc: want uint8 rows of {self.block_bytes} bytes, got {tuple(blocks.shape)} "
                             f"{blocks.dtype}")
        words = blocks.reshape(n, self.block_bytes).contiguous().view(torch.int32)
        cols1, cols2 = self._tables_on(words.device)
        segs = torch.empty(n * self.segments, dtype=torch.int32, device=words.device)
        if n:
            rows = n * self.segments
            _gf2_rows[(triton.cdiv(rows, 64),)](words, cols1, segs, rows, K=self.seg_words, BLOCK_R=64,
                                                BLOCK_K=64)
        out = torch.empty(n, dtype=torch.int32, device=words.device)
        if n:
            _gf2_rows[(triton.cdiv(n, 16),)](segs, cols2, out, n, K=self.segments, BLOCK_R=16, BLOCK_K=64)
        return out ^ self._zero
