"""Speculative decoding on CUDA: the verify steps' CUDA graphs (gpu_verify.py) give the eager
forward's logits (padding rows and padded sequences included), the draft model's graph-fed decode
steps give its eager drafts, and the whole loop (scheduler core, two steps in flight) runs with
both, replaying verify graphs, emitting exactly max_tokens."""
from __future__ import annotations

import pytest
import torch

from services.common import pb
from services.common.spec_config import parse_spec_config
from services.worker.attention import SeqSchedule
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.spec.decoder import SpecDecoder
from services.worker.spec.draft_model import DraftModel
from tests.overlap_driver import run
from tests.unit.tiny_llama import VOCAB, make_tiny_llama

NGRAM = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3, "dynamic_k": [[1, 64, 4]]})


def repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat a short pattern (n-gram lookup finds continuations in them). Not
    imported from tests/unit: those modules set TRITON_INTERPRET at import."""
    g = torch.Generator().manual_seed(11)
    return [((torch.randint(4, VOCAB, (3 + i % 3,), generator=g).tolist()) * 4)[: 8 + i] for i in range(n)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-spec-gpu"), seed=7)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, "cuda", torch.bfloat16)


@torch.inference_mode()
def test_verify_graph_logits_equal_the_eager_forwards(model):
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=64, block_size=4)
    runner.hello(4)
    runner.enable_spec(SpecDecoder(NGRAM))
    gpu = runner.gpu
    assert gpu.verify is not None and gpu.verify.graphs, "verify graphs captured with speculation on"
    g = torch.Generator().manual_seed(0)
    ctx = [10, 7, 12]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    # Fill the contexts' KV eagerly (a prefill step).
    ids = torch.randint(4, VOCAB, (sum(ctx),), generator=g).tolist()
    positions = [p for c in ctx for p in range(c)]
    gpu.run(ids, positions, [SeqSchedule(t, 0, c) for t, c in zip(tables, ctx)], [len(ids) - 1])
    # A verify step: rows of 5, 3 and 1 tokens (3 rows -> padded to 4 sequences, q = 5).
    counts = [5, 3, 1]
    seqs = sorted([SeqSchedule(t, c, n) for t, c, n in zip(tables, ctx, counts)], key=lambda s: s.num_scheduled_tokens != 1)
    vids = torch.randint(4, VOCAB, (sum(counts),), generator=g).tolist()
    vpos = [p for s in seqs for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)]
    rows = list(range(len(vids)))
    assert gpu.verify.key(seqs, len(vids), rows) == (4, 5)
    replays = []
    orig = gpu.verify.run
    gpu.verify.run = lambda *a, **k: replays.append(1) or orig(*a, **k)
    graphed, _ = gpu.run(vids, vpos, seqs, rows)
    assert replays, "the step replayed a verify graph"
    verify, gpu.verify = gpu.verify, None
    eager, _ = gpu.run(vids, vpos, seqs, rows)
    gpu.verify = verify
    torch.cuda.synchronize()
    assert graphed.shape == eager.shape == (len(vids), VOCAB)
    assert torch.isfinite(graphed).all()
    assert (graphed - eager).abs().max().item() < 0.05 * eager.abs().max().item()
    assert (graphed.argmax(1) == eager.argmax(1)).float().mean().item() >= 0.9


@torch.inference_mode()
def test_the_draft_models_graph_fed_steps_give_its_eager_drafts(tiny_dir):
    draft_model = load_model(tiny_dir, "cuda", torch.bfloat16)
    graphed = DraftModel(draft_model, 32, 4, max_num_tokens=256, cuda_graphs=True)
    eager = DraftModel(draft_model, 32, 4, max_num_tokens=256, cuda_graphs=False)
    ps = repetitive(3)
    for d in (graphed, eager):
        for i, p in enumerate(ps):
            d.start(f"r{i}", p)
    rows = [(f"r{i}", 4) for i in range(3)]
    got, want = graphed.propose(rows), eager.propose(rows)
    assert set(got) == {"r0", "r1", "r2"} and all(len(v) == 4 for v in got.values())
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_speculating_loop_on_cuda_replays_verify_graphs_and_stops_at_max_tokens(tiny_dir, model, method,
                                                                                    monkeypatch):
    if method == "ngram":   # the host proposer's verify steps (device-fed ones: test_spec_device_gpu.py)
        monkeypatch.setenv("MESHLLM_DEVICE_DRAFTS", "0")
        spec, draft = NGRAM, None
    else:
        spec = parse_spec_config({"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_dir),
                                  "dynamic_k": [[1, 64, 3]]})
        draft = load_model(tiny_dir, "cuda", torch.bfloat16)
    replays = []

    def watch(runner):
        verify = runner.gpu.verify
        if verify is not None:
            orig = verify.run
            verify.run = lambda *a, **k: replays.append(1) or orig(*a, **k)
    ps = repetitive(6)
    sps = [pb.common.SamplingParams(ignore_eos=True)] * 3 + [
        pb.common.SamplingParams(temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(3)]
    got, _, s, _ = run(model, ps, sps, overlap=True, new_tokens=24, spec=spec, draft_model=draft, watch=watch)
    assert all(len(v) == 24 for v in got.values())
    d = s.runner.spec
    assert d.drafted > 0 and d.accepted > 0
    assert replays, "verify steps ran as graphs"
