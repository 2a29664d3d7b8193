"""The CPU twin of the verify steps' CUDA graphs (gpu_verify.py): the stride-q layout they replay
(each row padded to q tokens that write no KV, padding sequences of context 0), run eagerly
through the executor's Triton forward under the interpreter, gives the packed step's logits and
leaves the KV cache exactly as the packed step does."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from services.worker.attention import SeqSchedule  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from tests.unit.tiny_llama import VOCAB, make_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-verify"), seed=3))


@torch.inference_mode()
def test_the_stride_q_layout_gives_the_packed_steps_logits_and_kv(model):
    pytest.importorskip("triton")
    from services.worker.gpu_exec import GpuExecutor
    from services.worker.gpu_verify import VerifyGraphs, verify_widths
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=32, block_size=4)
    runner.hello(4)
    ex = GpuExecutor(model, runner.kv_caches, 4, max_num_tokens=64, max_num_seqs=8, graph_sizes=None)
    g = torch.Generator().manual_seed(1)
    ctx, counts = [6, 3, 9], [1, 5, 3]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    ids = torch.randint(4, VOCAB, (sum(ctx),), generator=g).tolist()
    ex.run(ids, [p for c in ctx for p in range(c)], [SeqSchedule(t, 0, c) for t, c in zip(tables, ctx)],
           [len(ids) - 1])
    seqs = [SeqSchedule(t, c, n) for t, c, n in zip(tables, ctx, counts)]
    vids = torch.randint(4, VOCAB, (sum(counts),), generator=g).tolist()
    vpos = [p for s in seqs for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)]
    rows = list(range(len(vids)))
    packed, _ = ex.run(vids, vpos, seqs, rows)
    kv_packed = [c.clone() for c in runner.kv_caches]
    # Wipe the step's own slots (positions ctx..ctx+n of each row) so the layout must rewrite them.
    for t, c0, n in zip(tables, ctx, counts):
        for p in range(c0, c0 + n):
            for c in runner.kv_caches:
                c[:, t[p // 4], p % 4] = 0
    vg = VerifyGraphs(ex, 4)
    assert verify_widths(4) == [2, 3, 5] and vg.buckets[:3] == [1, 2, 4]
    strided = vg.run((4, 5), vids, vpos, seqs, None)        # 3 rows padded to 4 sequences x 5 tokens
    assert strided.shape == packed.shape == (len(vids), VOCAB)
    assert torch.allclose(strided, packed, atol=1e-4, rtol=1e-4)
    real = torch.zeros(runner.kv_caches[0].shape[1:3], dtype=torch.bool)    # [blocks, slots]
    for t, c0, n in zip(tables, ctx, counts):
        for p in range(c0, c0 + n):
            real[t[p // 4], p % 4] = True
    for c, want in zip(runner.kv_caches, kv_packed):
        assert torch.equal(c[:, ~real], want[:, ~real]), "padding tokens wrote no KV"
        assert torch.allclose(c[:, real], want[:, real], atol=1e-5), "real tokens wrote the packed step's KV"
