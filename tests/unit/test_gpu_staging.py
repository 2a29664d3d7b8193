"""The GPU executor's staged inputs (gpu_staging.copy_i32): block tables travel as wide as the
step's longest context needs, not as wide as the longest model length, and still land in the
device rows at the stride the kernels (and CUDA graphs) read them with."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from services.worker.attention import SeqSchedule  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from tests.unit.tiny_llama import make_tiny_llama  # noqa: E402

BS = 4


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    pytest.importorskip("triton")
    from services.worker.gpu_exec import GpuExecutor
    model = load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-staging"), max_pos=256))
    kv = [torch.zeros(model.kv_cache_shape(400, BS), dtype=model.dtype) for _ in model.layers]
    return GpuExecutor(model, kv, BS, max_num_tokens=64, max_num_seqs=8, graph_sizes=None)


def stage(ex, seqs: list[SeqSchedule], pad_to: int = 0) -> None:
    ids = [1] * sum(s.num_scheduled_tokens for s in seqs)
    pos = [p for s in seqs for p in range(s.num_computed_tokens, s.context_len)]
    ex._stage(ids, pos, seqs, pad_to=pad_to)


def test_short_contexts_copy_only_their_columns_and_reused_rows_read_right(executor):
    ex = executor
    assert ex.max_blocks == 64
    ex.tables.fill_(-7)                                   # stale device contents
    a = SeqSchedule(list(range(100, 110)), 37, 1)        # 38 tokens: 10 blocks
    b = SeqSchedule([200, 201, 202], 0, 9)               # a 9-token prompt: 3 blocks
    stage(ex, [a, b], pad_to=4)
    assert ex.tables[0, :10].tolist() == a.block_ids
    assert ex.tables[1, :3].tolist() == b.block_ids
    assert ex.lens[:4].tolist() == [38, 9, 0, 0] and ex.qsl[:5].tolist() == [0, 1, 10, 11, 12]
    # Only the 10 columns the longest context needs travelled; the rest keep what was there.
    assert (ex.tables[:, 10:] == -7).all()
    # Row 0 reused by a shorter request on the next step (each staging set alternates).
    c = SeqSchedule([300, 301], 5, 1)
    for _ in range(2):
        stage(ex, [c, a])
        assert ex.tables[0, :2].tolist() == [300, 301] and ex.tables[1, :10].tolist() == a.block_ids
        assert ex.lens[:2].tolist() == [6, 38]


def test_contexts_past_half_the_row_copy_whole_rows(executor):
    ex = executor
    ex.tables.fill_(-7)
    long = SeqSchedule(list(range(40)), 150, 1)          # 151 tokens: 38 of 64 blocks
    stage(ex, [long])
    assert ex.tables[0, :38].tolist() == long.block_ids[:38]
    assert not (ex.tables[0] == -7).any(), "the whole row was copied"
