"""The executor's start-up warm-up of eager steps (gpu_exec.warm_eager): it runs prompt-only and
mixed steps of every shape class Triton compiles apart (token counts with and without 16 | T,
each split-KV class of a mixed step's decode launch) so serving never stalls for the compiler,
writes nothing into the KV cache, and leaves the executor giving what a fresh one gives. CPU
twin: the executor's Triton forward under the interpreter."""
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
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-warm"), seed=5))


def executor(model, graph_sizes=None):
    from services.worker.gpu_exec import GpuExecutor
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=24, block_size=4)
    runner.hello(4)
    g = torch.Generator().manual_seed(2)
    for c in runner.kv_caches:          # stale values everywhere: a write would show
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    return GpuExecutor(model, runner.kv_caches, 4, max_num_tokens=64, max_num_seqs=4, graph_sizes=graph_sizes)


@torch.inference_mode()
def test_warm_up_covers_every_compiled_shape_class_and_writes_no_kv(model):
    pytest.importorskip("triton")
    from services.worker.kernels.attention import decode_splits
    ex = executor(model)
    kvh = model.cfg.num_kv_heads
    shapes = ex.warm_shapes()

    def decodes(sh):
        return sum(s == 1 for _, s in sh)
    mixed = [sh for sh in shapes if 0 < decodes(sh) < len(sh)]
    want = {decode_splits(n, kvh, ex.num_sms) for n in range(1, ex.max_seqs)}
    assert len(want) > 1
    total = {id(sh): sum(s for _, s in sh) for sh in shapes}
    # every split class of a mixed step's decode launch, each with T odd and even
    assert {(decode_splits(decodes(sh), kvh, ex.num_sms), total[id(sh)] % 2) for sh in mixed} == \
        {(c, p) for c in want for p in (0, 1)}
    assert {decodes(sh) % 2 for sh in mixed} == {0, 1}, "odd and even decode counts"
    prompts = [sh for sh in shapes if decodes(sh) == 0]
    assert {total[id(sh)] % 16 == 0 for sh in prompts} == {True, False}
    assert {total[id(sh)] % 2 for sh in prompts} == {0, 1}
    assert any(c > 0 and s > 1 for sh in prompts for c, s in sh), "a chunk after a cached prefix"
    # Eager only (no decode graphs): decode-only steps of every class, both parities.
    decode_only = [sh for sh in shapes if decodes(sh) == len(sh)]
    assert {decode_splits(len(sh), kvh, ex.num_sms) for sh in decode_only} == want
    assert {len(sh) % 2 for sh in decode_only} == {0, 1}

    # One step of each kind, run: nothing is written into the cache.
    before = [c.clone() for c in ex.kv_caches]
    ex.warm_eager([shapes[0], mixed[0], decode_only[0]])
    for c, b in zip(ex.kv_caches, before):
        assert torch.equal(c.view(torch.uint8), b.view(torch.uint8)), "the warm-up wrote KV"

    # ... and the executor then gives what a fresh one gives (over the same stale cache).
    fresh = executor(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, VOCAB, (5,), generator=g).tolist()
    mixed_seqs = [SeqSchedule(list(range(0, 3)), 9, 1), SeqSchedule(list(range(3, 6)), 0, 5)]
    step = ([ids[0]] + ids[:5], [9] + list(range(5)))
    want_logits, _ = fresh.run(*step, mixed_seqs, [0, 5])
    got, _ = ex.run(*step, mixed_seqs, [0, 5])
    assert torch.equal(got, want_logits)
