"""The GPU's CRC-32C of KV blocks (services/worker/kv_block_crc.py), run here by Triton's
interpreter: equal to the kvstore's checksum (the CPU's crc32c) on random blocks of several
sizes and segment cuts, changed by any flipped bit, and absent for sizes it does not cut."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from services.common.kv_blocks import checksum  # noqa: E402

kv_block_crc = pytest.importorskip("services.worker.kv_block_crc")
if kv_block_crc.triton is None:
    pytest.skip("no triton", allow_module_level=True)
BlockCrc = kv_block_crc.BlockCrc


def _cpu(blocks: torch.Tensor) -> list[int]:
    return [checksum(b.numpy()) for b in blocks]


@pytest.mark.parametrize("block_bytes", [8192, 12288, 256 * 3])   # 1024-word segments x2, x3; 64-word x3
def test_equals_the_cpu_checksum_on_random_blocks(block_bytes):
    crc = BlockCrc.for_size(block_bytes)
    assert crc is not None
    blocks = torch.randint(0, 256, (5, block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(block_bytes))
    got = crc(blocks)
    assert got.dtype == torch.int32 and [g & 0xFFFFFFFF for g in got.tolist()] == _cpu(blocks)
    # Of the same rows in another shape (the worker hands [n, *block_shape]).
    assert torch.equal(crc(blocks.view(5, 2, -1)), got)


def test_any_flipped_bit_changes_it():
    crc = BlockCrc.for_size(8192)
    base = torch.randint(0, 256, (1, 8192), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    bad = base.repeat(6, 1)
    for row, (byte, bit) in enumerate([(0, 0), (1, 7), (4095, 3), (4096, 0), (8191, 7), (2000, 5)]):
        bad[row, byte] ^= 1 << bit
    want = checksum(base[0].numpy())
    got = [g & 0xFFFFFFFF for g in crc(bad).tolist()]
    assert got == _cpu(bad) and want not in got


def test_sizes_it_does_not_cut_have_none_and_wrong_rows_are_refused():
    assert BlockCrc.for_size(8190) is None and BlockCrc.for_size(100) is None
    crc = BlockCrc.for_size(8192)
    assert crc(torch.empty((0, 8192), dtype=torch.uint8)).numel() == 0
    with pytest.raises(ValueError):
        crc(torch.zeros((1, 4096), dtype=torch.uint8))
