"""Decode CUDA graphs are captured when the worker starts, right after its KV cache is allocated,
not by the first step that needs one: every bucket exists once ModelRunner is built (and again
after a hello that re-allocates the cache for another block size), replaying them gives the eager
tokens, --enforce-eager captures nothing, and a capture that fails leaves a working eager worker."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from services.worker.gpu_exec import DEFAULT_GRAPH_SIZES, GpuExecutor
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.gpu.greedy_driver import greedy_with_top2
from tests.unit.tiny_llama import make_tiny_llama

# Four prompts: every decode step has 4 rows, a bucket of its own, so graph and eager runs have
# the very same shapes (no padding rows, the same split-KV choice).
PROMPTS = [[5, 9, 11, 40, 7, 3, 22, 61, 17], [8, 8, 30], [70, 2, 44, 12, 90, 13], [33] * 20]
NEW = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-graphs"), seed=7), "cuda", torch.bfloat16)


def make_runner(model, **kw) -> ModelRunner:
    return ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=64, block_size=16, **kw)


class CountingGraph:
    """A captured graph that records which bucket replayed."""

    def __init__(self, graph, bucket: int, replays: list[int]) -> None:
        self.graph, self.bucket, self.replays = graph, bucket, replays

    def replay(self) -> None:
        self.replays.append(self.bucket)
        self.graph.replay()


def test_every_bucket_is_captured_at_startup_and_again_for_a_new_block_size(model, caplog):
    with caplog.at_level(logging.INFO):
        runner = make_runner(model)
    sizes = runner.gpu.graph_sizes
    assert sizes and sizes == sorted(b for b in DEFAULT_GRAPH_SIZES if b <= runner.gpu.max_seqs)
    assert sorted(runner.gpu.graphs) == sizes
    assert runner.graph_capture_s > 0
    assert any(re.fullmatch(rf"captured {len(sizes)} decode CUDA graphs in [\d.]+ s .*", m) for m in caplog.messages)
    before = runner.gpu
    runner.hello(16)                      # same block size: the cache and its graphs stay
    assert runner.gpu is before
    runner.hello(8)                       # a new cache: its graphs are captured at once too
    assert runner.gpu is not before and sorted(runner.gpu.graphs) == runner.gpu.graph_sizes == sizes


def test_decode_through_the_startup_graphs_gives_the_eager_tokens(model):
    graphs, eager = make_runner(model), make_runner(model, enforce_eager=True)
    assert eager.gpu.graph_sizes == [] and eager.gpu.graphs == {} and eager.graph_capture_s == 0
    replays: list[int] = []
    for b, (graph, logits) in list(graphs.gpu.graphs.items()):
        graphs.gpu.graphs[b] = (CountingGraph(graph, b, replays), logits)
    got, got_top = greedy_with_top2(ProtoRunner(graphs), PROMPTS, NEW)
    want, want_top = greedy_with_top2(ProtoRunner(eager), PROMPTS, NEW)
    assert replays == [len(PROMPTS)] * (NEW - 1), "every decode step (all but the prefill) replays bucket 4"
    assert eager.gpu.graphs == {}, "eager runs capture nothing, not even lazily"
    assert got == want
    for g_rows, w_rows in zip(got_top, want_top):
        for g, w in zip(g_rows, w_rows):
            assert [t for t, _ in g] == [t for t, _ in w]
            assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-2)


def test_a_failed_capture_leaves_an_eager_worker(model, monkeypatch, caplog):
    want, _ = greedy_with_top2(ProtoRunner(make_runner(model, enforce_eager=True)), PROMPTS, 4)

    def fail(self, b):
        raise RuntimeError(f"capture of bucket {b} failed (test)")

    monkeypatch.setattr(GpuExecutor, "_capture", fail)
    with caplog.at_level(logging.WARNING):
        runner = make_runner(model)
    assert runner.gpu is not None and runner.gpu.graph_sizes == [] and runner.gpu.graphs == {}
    assert any("CUDA graph capture failed" in m and "eagerly" in m for m in caplog.messages)
    got, _ = greedy_with_top2(ProtoRunner(runner), PROMPTS, 4)
    assert got == want
