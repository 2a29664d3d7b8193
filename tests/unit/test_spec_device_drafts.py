"""Device-fed speculative steps (spec/device_steps.py, spec/device_ngram.py, gpu_fed.py): n-gram
drafts proposed on the device from the device's copy of each request's tokens, the step's
positions and slots fed from the device's lengths, the accepted tokens appended there behind the
sampler. With async scheduling (two steps in flight) speculating steps keep their overlap, and
tokens and logprobs stay exactly plain decoding's: greedy and seeded random rows, chunked
prefill, preemptions, prefix caching, the executor's stride-q layout."""
from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from services.common import pb  # noqa: E402
from services.common.spec_config import parse_spec_config  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.spec.device_ngram import NO_DRAFT, DeviceNgram  # noqa: E402
from services.worker.spec.ngram import NgramProposer  # noqa: E402
from tests.overlap_driver import BLOCK, run  # noqa: E402
from tests.unit.tiny_llama import make_tiny_llama  # noqa: E402
from tests.unit.test_spec_decoding import repetitive  # noqa: E402

NGRAM = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3})
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-fed"), seed=7))


def test_device_proposals_equal_the_host_proposers_on_random_streams():
    rng = random.Random(1)
    for _ in range(200):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        dev = DeviceNgram(n_min, n_max, 64, 6, 4, CPU)
        streams = [[rng.randint(0, 4) for _ in range(rng.randint(1, 40))] for _ in range(3)]
        for i, toks in enumerate(streams):
            dev.assign(f"r{i}")
        dev.sync([(f"r{i}", toks, -1) for i, toks in enumerate(streams)], torch.zeros(1, dtype=torch.long))
        ks = [rng.randint(0, 5) for _ in streams]
        drafts, length = dev.propose(torch.tensor([dev.slot[f"r{i}"] for i in range(3)]), torch.tensor(ks), 5, 64)
        for i, toks in enumerate(streams):
            want = NgramProposer(n_min, n_max, toks).propose(ks[i])
            row = drafts[i].tolist()
            assert row[:len(want)] == want and all(x == NO_DRAFT for x in row[len(want):])
            assert length[i] == len(toks)


def test_commit_appends_the_accepted_drafts_and_the_token_after_them():
    dev = DeviceNgram(1, 2, 32, 4, 2, CPU)
    dev.assign("a"), dev.assign("b")
    prev = torch.tensor([0, 9, 0])
    dev.sync([("a", [1, 2, 3], -1), ("b", [5, 6], 1)], prev)   # b's pending token 9 is prev_tokens[1]
    slots = torch.tensor([dev.slot["a"], dev.slot["b"]])
    drafts = torch.tensor([[4, 5, 6], [7, NO_DRAFT, NO_DRAFT]])
    sampled = torch.tensor([[4, 5, 8, 1], [3, 2, 2, 2]])          # a: 2 accepted then 8; b: 0 accepted, then 3
    acc = dev.commit(slots, drafts, sampled)
    assert acc.tolist() == [2, 0]
    _, length = dev.propose(slots, torch.tensor([0, 0]), 1, 32)
    assert length.tolist() == [6, 4]
    assert dev.inputs(slots, length).tolist() == [8, 3]
    assert dev.hist[dev.slot["b"], dev.lead:dev.lead + 4].tolist() == [5, 6, 9, 3]
    # A released row is filled again from the host when a request takes it.
    dev.release("a")
    assert dev.assign("c") == slots[0].item() and dev.synced["c"] == 0


def greedy_and_seeded(n: int) -> list[pb.common.SamplingParams]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(pb.common.SamplingParams(ignore_eos=True, logprobs=2))
        elif i % 3 == 1:
            out.append(pb.common.SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, ignore_eos=True))
        else:
            out.append(pb.common.SamplingParams(ignore_eos=True))
    return out


def _executor(model):
    from services.worker.gpu_exec import GpuExecutor
    return lambda r: GpuExecutor(model, r.kv_caches, BLOCK, max_num_tokens=64, max_num_seqs=8, graph_sizes=None)


def test_device_fed_steps_give_plain_decodings_tokens_and_logprobs_and_keep_the_overlap(model):
    """The reference forward's twin (the executor's stride-q layout under the interpreter: the
    random-widths test below)."""
    n, new = 4, 16
    ps, sps = repetitive(n), greedy_and_seeded(n)
    want, want_lp, _, _ = run(model, ps, sps, overlap=False, new_tokens=new)
    got, got_lp, s, depth = run(model, ps, sps, overlap=True, new_tokens=new, spec=NGRAM)
    assert got == want
    assert all(len(v) == new for v in got.values()), "exactly max_tokens"
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=1e-5)
    spec = s.runner.spec
    assert spec.fed_steps > 0 and spec.drafted > 0
    assert depth == 2, "speculating steps keep two steps in flight"


def test_device_fed_steps_with_chunked_prefill_preemption_and_prefix_caching(model):
    ps = repetitive(6) + repetitive(2)      # the last two repeat earlier prompts: prefix-cache hits
    sps = greedy_and_seeded(8)
    want, _, _, _ = run(model, ps, sps, overlap=True, new_tokens=20, num_blocks=64, budget=16)
    got, _, s, _ = run(model, ps, sps, overlap=True, new_tokens=20, num_blocks=14, budget=16,
                       prefix_caching=True, spec=NGRAM)
    assert s.num_preemptions > 0
    assert got == want
    assert s.runner.spec.fed_steps > 0


def test_decode_steps_go_back_to_the_device_after_host_verified_prefill_steps(model):
    """Steps with prefill rows (chunked here; a request arriving while others decode) are host
    steps, with host drafts. Outputs limited to two tokens always find an n-gram match, so every
    host step drafts: the decode steps after them must still run fed from the device (they used
    to stay host steps for good, each reading its predecessor first), with plain decoding's tokens."""
    ps = repetitive(6)

    def biased():
        sp = pb.common.SamplingParams(ignore_eos=True)
        sp.logit_bias[7] = 50.0
        sp.logit_bias[9] = 50.0
        return sp
    steps = []

    def watch(runner):
        submit = runner.submit

        def counted(plan):
            before = runner.spec.fed_steps
            out = submit(plan)
            decode = bool(plan.cached_requests) and not plan.new_requests and all(
                r.num_computed_tokens >= len(ps[int(r.request_id[1:])]) for r in plan.cached_requests)
            steps.append((decode, runner.spec.fed_steps > before))
            return out
        runner.submit = counted
    want, _, _, _ = run(model, ps, [biased() for _ in ps], overlap=False, new_tokens=24, budget=16)
    got, _, s, _ = run(model, ps, [biased() for _ in ps], overlap=True, new_tokens=24, budget=16, spec=NGRAM,
                       watch=watch)
    assert got == want
    host_spec = [i for i, (decode, fed) in enumerate(steps) if not decode and i + 1 < len(steps) and steps[i + 1][0]]
    assert host_spec, "the run has prefill steps followed by decode steps"
    decode_steps = [fed for decode, fed in steps if decode]
    assert len(decode_steps) >= 10 and all(decode_steps), steps
    assert s.runner.spec.drafted > 0


def test_penalised_rows_take_the_host_path_and_the_device_path_can_be_turned_off(model, monkeypatch):
    ps = repetitive(3)
    pen = [pb.common.SamplingParams(repetition_penalty=1.3, ignore_eos=True)] * 3
    want, _, _, _ = run(model, ps, pen, overlap=False, new_tokens=12)
    got, _, s, _ = run(model, ps, pen, overlap=True, new_tokens=12, spec=NGRAM)
    assert got == want and s.runner.spec.fed_steps == 0
    monkeypatch.setenv("MESHLLM_DEVICE_DRAFTS", "0")
    sps = greedy_and_seeded(3)
    want, _, _, _ = run(model, ps, sps, overlap=False, new_tokens=12)
    got, _, s, _ = run(model, ps, sps, overlap=True, new_tokens=12, spec=NGRAM)
    assert got == want and s.runner.spec.device is None and s.runner.spec.fed_steps == 0


def test_smollm2_copying_a_passage_accepts_most_device_drafts_in_overlapped_steps(smollm2_dir):
    """A real model asked to copy text, greedy and seeded random: the device's n-gram drafts are
    mostly accepted (so positions really move by the accepted count on the device, and random rows
    draw from the shifted position's seed), and the tokens are plain decoding's."""
    from tokenizers import Tokenizer
    smol = load_model(smollm2_dir)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    passage = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step."
    prompt = tok.encode(f"<|im_start|>user\nRepeat exactly: {passage}<|im_end|>\n<|im_start|>assistant\n").ids
    spec = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    sps = [pb.common.SamplingParams(ignore_eos=True),
           pb.common.SamplingParams(temperature=1.0, seed=5, ignore_eos=True, logprobs=1)]
    want, want_lp, _, _ = run(smol, [prompt, prompt], sps, overlap=False, new_tokens=24, num_blocks=32)
    got, got_lp, s, depth = run(smol, [prompt, prompt], sps, overlap=True, new_tokens=24, num_blocks=32, spec=spec)
    assert got == want
    assert got_lp["r1"] == pytest.approx(want_lp["r1"], abs=1e-4)
    d = s.runner.spec
    assert d.fed_steps > 0 and depth == 2
    assert d.drafted > 0 and d.accepted / d.drafted > 0.5, (d.drafted, d.accepted)


def test_a_windowed_row_draws_with_the_seed_of_the_position_its_device_shift_picks():
    """Random rows of a device-fed step: the host knows the draw's position only up to the last
    step's accepted count; the shift (on the device) picks the noise of the true position."""
    from services.worker.plan import SamplingConfig
    from services.worker.sampling import SampleRow, sample_async
    cfg = SamplingConfig(temperature=1.0)
    logits = torch.zeros(1, 50)            # uniform: the draw is the noise alone
    differ = 0
    for seed in range(20):
        want = sample_async(logits.clone(), [SampleRow(cfg, [], 0, seed, position=12)]).result()[0].token_id
        got = sample_async(logits.clone(), [SampleRow(cfg, [], 0, seed, position=10, window=3,
                                                      shift=torch.tensor([2]))]).result()[0].token_id
        at_lo = sample_async(logits.clone(), [SampleRow(cfg, [], 0, seed, position=10)]).result()[0].token_id
        assert got == want
        differ += at_lo != want
    assert differ > 10, "the shift matters"


def test_the_feed_and_commit_kernels_equal_their_torch_twins():
    """kernels/spec_fed.py under the interpreter against device_ngram.py's propose / inputs / commit:
    drafts, the stride-q layout's ids, positions, KV slots (-1 past a row's cap), context lengths,
    shifts, and the rows after the commit."""
    pytest.importorskip("triton")
    from services.worker.kernels.spec_fed import commit, feed
    rng = random.Random(5)
    bs, mb, q = 4, 16, 4
    for trial in range(6):
        n_min = rng.randint(1, 2)
        n_max = rng.randint(n_min, 4)
        twins = [DeviceNgram(n_min, n_max, 60, q, 4, CPU) for _ in range(2)]
        streams = [[rng.randint(0, 3) for _ in range(rng.randint(1, 50))] for _ in range(3)]
        for dev in twins:
            for i in range(3):
                dev.assign(f"r{i}")
            dev.sync([(f"r{i}", t, -1) for i, t in enumerate(streams)], torch.zeros(1, dtype=torch.long))
        slots = [twins[0].slot[f"r{i}"] for i in range(3)]
        ks = [rng.randint(0, q - 1) for _ in range(3)]
        caps = [len(t) + rng.randint(0, q) for t in streams]        # some rows run past their cap
        starts = [len(t) - 1 - rng.randint(0, 1) for t in streams]
        tables = torch.randint(0, 99, (3, mb), dtype=torch.int32)
        rows = torch.zeros(4, 3 * q, dtype=torch.long)
        lens = torch.zeros(3, dtype=torch.int32)
        meta = torch.tensor([slots, ks, caps, starts], dtype=torch.long)
        drafts, shift = feed(twins[0].hist, twins[0].hlen, meta, tables, rows, lens, lead=twins[0].lead,
                             n_min=n_min, n_max=n_max, q=q, block_size=bs, limit=mb * bs)
        t_drafts, length = twins[1].propose(torch.tensor(slots), torch.tensor(ks), q - 1, 64)
        assert torch.equal(drafts, t_drafts), trial
        p = length - 1
        assert torch.equal(shift, p - torch.tensor(starts))
        assert torch.equal(lens, (p + q).to(torch.int32))
        pos = p[:, None] + torch.arange(q)
        cap = torch.tensor(caps)[:, None]
        want_pos = torch.minimum(pos, cap - 1)
        blk = tables.long().gather(1, want_pos // bs)
        assert torch.equal(rows[1].view(3, q), want_pos)
        assert torch.equal(rows[2].view(3, q), torch.where(pos < cap, blk * bs + want_pos % bs, -1))
        tok0 = twins[1].inputs(torch.tensor(slots), length)
        assert torch.equal(rows[0].view(3, q), torch.cat([tok0[:, None], t_drafts.clamp(min=0)], 1))
        assert (rows[3] == -1).all()
        sampled = torch.where(torch.rand(3, q) < 0.6, torch.cat([t_drafts, torch.zeros(3, 1, dtype=torch.long)], 1),
                              torch.randint(0, 3, (3, q)))
        commit(twins[0].hist, twins[0].hlen, meta[0].clone(), drafts, sampled.contiguous(), lead=twins[0].lead,
               max_len=60)
        twins[1].commit(torch.tensor(slots), t_drafts, sampled)
        assert torch.equal(twins[0].hlen, twins[1].hlen)
        for s, n_tok in zip(slots, twins[1].hlen[slots].tolist()):
            lead = twins[0].lead
            assert torch.equal(twins[0].hist[s, :lead + n_tok], twins[1].hist[s, :lead + n_tok])


def test_the_start_up_warm_up_runs_every_width_and_leaves_the_rows_clean(model):
    pytest.importorskip("triton")
    from services.worker.gpu_exec import GpuExecutor
    from services.worker.gpu_fed import warm_up
    from services.worker.runner import ModelRunner
    from services.worker.spec.device_ngram import PAD
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=16, block_size=BLOCK)
    runner.hello(BLOCK)
    ex = GpuExecutor(model, runner.kv_caches, BLOCK, max_num_tokens=64, max_num_seqs=16, graph_sizes=None)
    dev = DeviceNgram(1, 3, 64, 5, 16, CPU)   # 16 rows: the divisible-by-16 variant too
    dev.hist[1, 3:9] = 7
    warm_up(ex, dev, [1, 3])
    assert (dev.hlen == 0).all() and (dev.hist == PAD).all()


def test_the_width_choice_follows_measured_step_periods():
    """The calibration says width 5 pays at 32 rows (GPU time alone); once steps of that width are
    measured to take far longer from submit to submit (the loop's host side), it says no; a width
    whose period is forgotten is tried again."""
    from services.worker.spec.decoder import PERIOD_REVISIT, SpecDecoder
    from services.worker.spec.device_steps import _choose_width
    from services.worker.spec.dynamic_k import StepCostModel, VerifyCostModel
    spec = SpecDecoder(parse_spec_config({"method": "ngram", "num_speculative_tokens": 4}))
    spec.plain_cost = StepCostModel([(1, 1e-3), (32, 1.2e-3)])
    spec.spec_cost = VerifyCostModel([(32, 64, 1.3e-3), (32, 160, 1.6e-3)], plain=spec.plain_cost)
    rows = [(f"r{i}", 4, 100) for i in range(32)]
    for i in range(32):
        spec.acceptance.update(f"r{i}", 8, 7)
    assert _choose_width(spec, rows, 32, [1, 2, 3, 5]) == 5
    for _ in range(5):
        spec.step_period(32, 1, 1.4e-3)
        spec.step_period(32, 5, 6e-3)
    assert _choose_width(spec, rows, 32, [1, 2, 3, 5]) == 3, "width 3 not measured: the estimate stands"
    spec.step_period(32, 3, 6e-3)
    spec.step_period(32, 2, 6e-3)
    assert _choose_width(spec, rows, 32, [1, 2, 3, 5]) == 1
    host_rows = [(rid, room) for rid, room, _ in rows]
    assert spec.worth_trying(host_rows, 32, 32), "the host path's own cost model would draft"
    spec.fed_declined_at = spec.acceptance.clock      # what fed_plan records when it picks width 1
    assert not spec.worth_trying(host_rows, 32, 32), "one decision a step: no host drafts either"
    for _ in range(PERIOD_REVISIT):
        spec.acceptance.tick()
    assert _choose_width(spec, rows, 32, [1, 2, 3, 5]) == 5


def random_widths(monkeypatch, seed: int) -> list[int]:
    """The device-fed width choice replaced by a seeded random one -> the widths it picks."""
    import services.worker.spec.device_steps as device_steps
    rng = random.Random(seed)
    picked: list[int] = []

    def pick(spec, rows, n, widths):
        picked.append(rng.choice(widths))
        return picked[-1]
    monkeypatch.setattr(device_steps, "_choose_width", pick)
    return picked


@pytest.mark.parametrize("layout", ["reference", "executor"])
def test_any_sequence_of_widths_gives_plain_decodings_tokens(model, monkeypatch, layout):
    """Whatever width the cost model picks step after step (here a seeded random one: wide, one
    token fed from the device, then a plain host step once nothing is left to feed), the tokens are
    plain decoding's."""
    if layout == "executor":
        pytest.importorskip("triton")
    picked = random_widths(monkeypatch, 3)
    n, new = (2, 8) if layout == "executor" else (6, 20)
    ps, sps = repetitive(n), greedy_and_seeded(n)
    want, _, _, _ = run(model, ps, sps, overlap=False, new_tokens=new, num_blocks=64)
    got, _, s, depth = run(model, ps, sps, overlap=True, new_tokens=new, num_blocks=24 if n == 6 else 64,
                           budget=16, spec=NGRAM, executor=_executor(model) if layout == "executor" else None)
    assert got == want and depth == 2
    assert 1 in picked and max(picked) > 1
    assert s.runner.spec.fed_steps < len(picked), "a width of 1 with nothing to feed is a plain host step"
