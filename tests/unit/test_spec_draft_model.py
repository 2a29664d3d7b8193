"""Speculative decoding with a draft model (spec/draft_model.py): a second model with its own paged
KV pool proposes greedy drafts. Outputs, seeded samples and logprobs equal plain decoding's with
async scheduling on and off, a poor drafter, chunked prefill, preemptions, prefix caching and a
draft pool too small for every request; a model drafting for itself has nearly every draft
accepted; the draft's KV bookkeeping after partial acceptance gives the drafts of a fresh start;
the worker's loader builds it from --speculative-config and refuses a vocabulary that does not fit."""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from services.common import pb  # noqa: E402
from services.common.spec_config import SpecConfigError, check_served, parse_spec_config  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.spec.draft_model import DraftModel  # noqa: E402
from tests.overlap_driver import run  # noqa: E402
from tests.unit.test_spec_decoding import mix, repetitive  # noqa: E402
from tests.unit.tiny_llama import make_tiny_llama  # noqa: E402

TOKENIZER = {"model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(96)}}, "added_tokens": []}


def _spec(path, k: int = 3, **extra):
    return parse_spec_config({"method": "draft_model", "num_speculative_tokens": k, "model": str(path), **extra})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = make_tiny_llama(tmp_path_factory.mktemp("draft-target"), seed=7)
    other = make_tiny_llama(tmp_path_factory.mktemp("draft-other"), seed=8)
    for d in (target, other):
        (d / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    return target, other


@pytest.fixture(scope="module")
def target(dirs):
    return load_model(dirs[0])


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_model_drafting_for_itself_gives_plain_decodings_tokens_and_accepts_greedy_drafts(dirs, target, overlap):
    ps, sps = repetitive(6), [mix(i) for i in range(6)]
    want, want_lp, _, _ = run(target, ps, sps, overlap=overlap, new_tokens=20)
    got, got_lp, s, _ = run(target, ps, sps, overlap=overlap, new_tokens=20, spec=_spec(dirs[0]),
                            draft_model=load_model(dirs[0]))
    assert got == want
    assert all(len(v) == 20 for v in got.values()), "exactly max_tokens, never one past"
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=1e-4)
    d = s.runner.spec
    assert d.drafted > 0 and d.accepted > 0, (d.drafted, d.accepted)


def test_greedy_self_drafts_are_nearly_all_accepted(dirs, target):
    ps = repetitive(4)
    sps = [pb.common.SamplingParams(ignore_eos=True)] * 4
    want, _, _, _ = run(target, ps, sps, overlap=True, new_tokens=24)
    got, _, s, depth = run(target, ps, sps, overlap=True, new_tokens=24, spec=_spec(dirs[0], k=4),
                           draft_model=load_model(dirs[0]))
    assert got == want
    d = s.runner.spec
    assert d.drafted >= 40 and d.accepted / d.drafted > 0.95, (d.drafted, d.accepted)
    # With async scheduling the draft's chains are drafted before each step's forward and checked
    # on the device (spec/device_chains.py): no step waits for the one before.
    assert d.fed_steps > 0 and depth == 2


def test_after_a_chain_the_kept_draft_kv_gives_a_fresh_starts_drafts(dirs):
    """Chains (propose_chains) run past the step in flight; when the real tokens arrive (in one
    piece or two, all equal to the chain or not) the KV kept for them gives the drafts a drafter
    starting from the whole context would give."""
    model = load_model(dirs[1])
    ctx = repetitive(1)[0]
    kept = DraftModel(model, 32, 4)
    kept.start("r", ctx)
    for trial, (take, wrong_at) in enumerate([(3, None), (2, 1), (6, None), (4, 0), (5, 3)]):
        chain = kept.propose_chains([("r", 7)], 8)[0].tolist()
        assert chain[7] == -1 and -1 not in chain[:7]
        new = chain[:take]
        if wrong_at is not None:
            new[wrong_at] = (new[wrong_at] + 1) % 96
        kept.extend("r", new[:1])            # the real tokens arrive in two steps
        kept.extend("r", new[1:])
        ctx = ctx + new
        fresh = DraftModel(model, 32, 4)
        fresh.start("r", ctx)
        ran = []
        forward = kept._forward
        kept._forward = lambda ids, *a: ran.append(len(ids)) or forward(ids, *a)
        assert kept.propose([("r", 4)])["r"] == fresh.propose([("r", 4)])["r"], trial
        kept._forward = forward
        right = take if wrong_at is None else wrong_at          # real tokens whose chain KV is kept
        assert ran == [max(1, take - right)], "the catch-up runs only the tokens the chain got wrong"


def test_a_poor_drafter_costs_acceptance_never_correctness(dirs, target):
    ps, sps = repetitive(5), [mix(i) for i in range(5)]
    want, want_lp, _, _ = run(target, ps, sps, overlap=True, new_tokens=16)
    got, got_lp, s, _ = run(target, ps, sps, overlap=True, new_tokens=16, spec=_spec(dirs[1]),
                            draft_model=load_model(dirs[1]))
    assert got == want
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=1e-4)
    d = s.runner.spec
    assert d.drafted > 0 and d.accepted < d.drafted, "another model's drafts are sometimes rejected"


def test_chunked_prefill_preemption_prefix_caching_and_a_full_draft_pool(dirs, target):
    ps = repetitive(6) + repetitive(2)      # the last two repeat earlier prompts: prefix-cache hits
    sps = [mix(i) for i in range(8)]
    want, _, _, _ = run(target, ps, sps, overlap=True, new_tokens=20, num_blocks=64, budget=16)
    # 14 target blocks force preemptions; 9 draft blocks hold two requests' contexts at most.
    got, _, s, _ = run(target, ps, sps, overlap=True, new_tokens=20, num_blocks=14, budget=16,
                       prefix_caching=True, spec=_spec(dirs[0]), draft_model=load_model(dirs[0]), draft_blocks=9)
    assert s.num_preemptions > 0
    assert got == want
    assert s.runner.spec.drafted > 0


def test_after_partial_acceptance_the_draft_kv_gives_a_fresh_starts_drafts(dirs):
    """Feed drafts, accept some (and a different next token), propose again: the proposal equals
    that of a drafter that starts from the whole context with no KV (the kept KV is right)."""
    model = load_model(dirs[1])
    ctx = repetitive(1)[0]
    kept = DraftModel(model, 32, 4)
    kept.start("r", ctx)
    first = kept.propose([("r", 4)])["r"]
    for accepted in (0, 1, 3):
        other = (first[accepted] + 1) % 96 if accepted < len(first) else 5
        new = first[:accepted] + [other]
        kept.extend("r", new)
        assert kept.seqs["r"].computed == len(ctx) + min(accepted, len(first) - 1)
        ctx = ctx + new
        fresh = DraftModel(model, 32, 4)
        fresh.start("r", ctx)
        first = kept.propose([("r", 4)])["r"]
        assert first == fresh.propose([("r", 4)])["r"]


def test_the_pool_frees_idle_requests_and_skips_rows_it_cannot_hold(dirs):
    model = load_model(dirs[1])
    d = DraftModel(model, 6, 4)                  # 24 token slots
    d.start("a", list(range(4, 14)))             # 10 tokens + 2 drafts: 3 blocks
    d.start("b", list(range(20, 30)))
    assert set(d.propose([("a", 3), ("b", 3)])) == {"a", "b"}
    assert not d._free
    d.start("c", list(range(40, 50)))
    assert set(d.propose([("c", 3)])) == {"c"}, "the least recently used idle request gave its blocks"
    assert d.seqs["a"].blocks == [] and d.seqs["a"].computed == 0
    d.start("big", list(range(4, 40)))           # 36 tokens: more than the pool
    assert d.propose([("big", 2), ("b", 2)]).keys() <= {"b"}
    assert "big" not in d.propose([("big", 2)])
    d.finish("b")
    d.finish("c")
    assert len(d._free) == 6 - len(d.seqs["big"].blocks) - len(d.seqs["a"].blocks)


def test_the_worker_loads_the_draft_from_the_flag_and_refuses_a_vocabulary_that_does_not_fit(dirs, tmp_path):
    from services.worker.config import WorkerConfig
    from services.worker.load import load_model_runner
    target_dir, draft_dir = dirs
    flag = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft_dir)})
    cfg = WorkerConfig(model=str(target_dir), zmq_addr="ipc:///tmp/unused.ipc", speculative_config=flag,
                       num_kv_blocks=32, block_size=4)
    runner = load_model_runner(cfg)
    draft = runner.spec.draft
    assert isinstance(draft, DraftModel) and draft.num_blocks == runner.num_blocks == 32
    assert runner.spec.draft_cost is not None, "the draft's step cost was calibrated"
    # A draft whose vocabulary exceeds the target's: refused by the launcher's check and the loader.
    big = make_tiny_llama(tmp_path / "big-vocab", seed=3, vocab=128)
    (big / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    text = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(big)})
    with pytest.raises(SpecConfigError, match="must fit inside the target's"):
        check_served(text, 1, str(target_dir))
    from services.worker.models.config import ModelConfigError
    from services.worker.spec.draft_model import load_draft_model
    with pytest.raises(ModelConfigError, match="larger than the target's"):
        load_draft_model(parse_spec_config(text), runner.model, 8, 4, dtype=torch.float32, max_num_tokens=64,
                         cuda_graphs=False)


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(dirs, tmp_path):
    target_dir, _ = dirs
    other = make_tiny_llama(tmp_path / "other-tok", seed=4)
    vocab = dict(TOKENIZER["model"]["vocab"])
    vocab["t1"], vocab["t2"] = 2, 1
    (other / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    with pytest.raises(SpecConfigError, match="does not share the target's tokenizer"):
        check_served(json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(other)}),
                     1, str(target_dir))


def test_smollm2_drafting_for_itself_accepts_nearly_everything_and_the_metrics_say_so(smollm2_dir):
    from tokenizers import Tokenizer
    from services.worker.metrics import SPEC_ACCEPTED_AT, SPEC_DRAFTED_AT, SPEC_ROWS
    smol = load_model(smollm2_dir)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n").ids
    sp = [pb.common.SamplingParams(ignore_eos=True)]
    spec = _spec(smollm2_dir, k=4)

    def value(metric, *labels):
        return metric.labels("", "draft_model", *labels)._value.get()
    before = (value(SPEC_ROWS), value(SPEC_DRAFTED_AT, "1"), value(SPEC_ACCEPTED_AT, "4"))
    want, _, _, _ = run(smol, [prompt], sp, overlap=False, new_tokens=16, num_blocks=24)
    got, _, s, _ = run(smol, [prompt], sp, overlap=False, new_tokens=16, num_blocks=24, spec=spec,
                       draft_model=load_model(smollm2_dir))
    assert got == want
    d = s.runner.spec
    assert d.drafted >= 12 and d.accepted / d.drafted > 0.9, (d.drafted, d.accepted)
    rows = value(SPEC_ROWS) - before[0]
    assert rows > 0 and value(SPEC_DRAFTED_AT, "1") - before[1] == rows
    assert value(SPEC_ACCEPTED_AT, "4") - before[2] > 0, "whole runs of 4 drafts were accepted"


def test_a_draft_behind_by_a_long_backlog_is_priced_its_catch_up(dirs):
    """The draft catches up lazily on every token since a request's last draft: the K choice
    prices that forward, so a request the draft fell far behind (a stretch of K = 0) does not
    draft where one it kept up with does (same acceptance, same costs)."""
    from services.worker.spec.decoder import SpecDecoder
    from services.worker.spec.dynamic_k import StepCostModel
    d = DraftModel(load_model(dirs[1]), 64, 4)
    spec = SpecDecoder(parse_spec_config({"method": "draft_model", "model": str(dirs[1]),
                                          "num_speculative_tokens": 4}), draft=d)
    spec.plain_cost = StepCostModel([(1, 10e-3), (64, 12e-3)])
    spec.spec_cost = StepCostModel([(1, 10e-3), (8, 10.5e-3), (512, 40e-3)])
    # a draft step of one row costs a quarter of the target's; a forward of 100 tokens ~26 ms
    spec.draft_cost = StepCostModel([(1, 2.5e-3), (64, 20e-3), (512, 90e-3)])
    for rid in ("kept", "behind"):
        spec.start(rid, list(range(4, 20)), 0)
        spec.acceptance.update(rid, 8, 7)
    assert set(d.propose([("kept", 2), ("behind", 2)])) == {"kept", "behind"}
    spec.extend("kept", [5])
    spec.extend("behind", [4 + i % 20 for i in range(100)])   # 100 tokens since its last draft
    assert d.backlog(["kept"]) == 1 and d.backlog(["behind"]) == 100
    assert spec._draft_k([("kept", 4)], 1, 1) > 0
    assert spec._draft_k([("behind", 4)], 1, 1) == 0
    d.propose([("behind", 1)])                       # caught up (as after any draft)
    assert spec._draft_k([("behind", 4)], 1, 1) > 0
