"""Suffix decoding's device-fed steps (spec/device_chains.py): the host proposes a chain past the
step in flight while the device runs it; the device keeps the chain's drafts where the chain's
head equals the tokens that step really emitted (else the n-gram search's). Tokens stay exactly plain decoding's,
with two steps in flight."""
from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from services.common import pb  # noqa: E402
from services.common.spec_config import parse_spec_config  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from services.worker.spec.device_chains import DeviceChains  # noqa: E402
from services.worker.spec.device_ngram import NO_DRAFT  # noqa: E402
from services.worker.spec.ngram import NgramProposer  # noqa: E402
from tests.overlap_driver import run  # noqa: E402
from tests.unit.test_spec_decoding import repetitive  # noqa: E402
from tests.unit.test_spec_device_drafts import _executor, greedy_and_seeded, random_widths  # noqa: E402
from tests.unit.tiny_llama import make_tiny_llama  # noqa: E402

SUFFIX = parse_spec_config({"method": "suffix", "num_speculative_tokens": 4})
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-chains"), seed=7))


def random_chains(rng, k_max: int, n: int):
    """n rows: (stream, anchor, chain of chain_len with NO_DRAFT padding, drafts wanted), chains
    that often start with the stream's tokens past the anchor (and sometimes differ there)."""
    ch = 2 * k_max + 1
    rows = []
    for _ in range(n):
        stream = [rng.randint(0, 3) for _ in range(rng.randint(1, 30))]
        m = rng.randint(0, min(len(stream) - 1, ch + 1))
        anchor = len(stream) - m
        chain = stream[anchor:] + [rng.randint(0, 3) for _ in range(ch)]
        if rng.random() < 0.3 and m:
            chain[rng.randrange(m)] = 9                               # a wrong guess of the step in flight
        chain = chain[:rng.randint(0, ch)]
        rows.append((stream, anchor, chain + [NO_DRAFT] * (ch - len(chain)), rng.randint(0, k_max)))
    return rows


def expected(stream, anchor, chain, k, n_min=1, n_max=3):
    """The chain's tokens after its head where the head is right and one follows; else the n-gram
    search's over the stream."""
    m = len(stream) - anchor
    out = []
    if m <= len(chain) and chain[:m] == stream[anchor:]:
        for x in chain[m:m + k]:
            if x == NO_DRAFT:
                break
            out.append(x)
    return out or NgramProposer(n_min, n_max, stream).propose(k)


def synced(k_max, rows, n_min=1, n_max=3):
    dev = DeviceChains(k_max, n_min, n_max, 64, k_max + 1, len(rows), CPU)
    for i, (stream, _, _, _) in enumerate(rows):
        dev.assign(f"r{i}")
    dev.sync([(f"r{i}", r[0], -1) for i, r in enumerate(rows)], torch.zeros(1, dtype=torch.long))
    slots = torch.tensor([dev.slot[f"r{i}"] for i in range(len(rows))])
    chains = torch.tensor([[a, *c] for _, a, c, _ in rows])
    return dev, slots, chains


def test_a_chain_drafts_where_its_head_is_what_the_step_in_flight_emitted_else_the_ngram_search():
    rng = random.Random(2)
    for _ in range(100):
        k_max = rng.randint(1, 5)
        rows = random_chains(rng, k_max, 4)
        dev, slots, chains = synced(k_max, rows)
        drafts, length = dev.propose(slots, torch.tensor([r[3] for r in rows]), k_max, 64, chains=chains)
        for i, (stream, anchor, chain, k) in enumerate(rows):
            want = expected(stream, anchor, chain, k)
            row = drafts[i].tolist()
            assert row[:len(want)] == want and all(x == NO_DRAFT for x in row[len(want):]), (stream, anchor, chain, k)
            assert length[i] == len(stream)


def test_the_feed_kernel_takes_host_chains_as_its_torch_twin_does():
    pytest.importorskip("triton")
    from services.worker.kernels.spec_fed import feed
    rng = random.Random(4)
    bs, mb = 4, 16
    for trial in range(4):
        k_max = rng.choice([2, 3, 4])      # chain_len 5, 7 and 9: padded and exact powers of two
        q = k_max + 1
        rows = random_chains(rng, k_max, 4)
        dev, slots, chains = synced(k_max, rows)
        ks = [r[3] for r in rows]
        caps = [len(r[0]) + q for r in rows]
        meta = torch.tensor([slots.tolist(), ks, caps, [len(r[0]) - 1 for r in rows]], dtype=torch.long)
        ids = torch.zeros(4, 4 * q, dtype=torch.long)
        drafts, _ = feed(dev.hist, dev.hlen, meta, torch.zeros(4, mb, dtype=torch.int32), ids,
                         torch.zeros(4, dtype=torch.int32), lead=dev.lead, n_min=1, n_max=3, q=q, block_size=bs,
                         limit=mb * bs, chains=chains.contiguous())
        want, length = dev.propose(slots, torch.tensor(ks), q - 1, 64, chains=chains)
        assert torch.equal(drafts, want), trial
        tok0 = dev.inputs(slots, length)
        assert torch.equal(ids[0].view(4, q), torch.cat([tok0[:, None], want.clamp(min=0)], 1))


def suffix_equals_plain_decoding(model, n: int, new: int):
    """n repetitive requests (greedy and seeded), overlapped with suffix speculation: tokens and
    logprobs are plain decoding's -> (the scheduler, the most steps in flight)."""
    ps, sps = repetitive(n), greedy_and_seeded(n)
    want, want_lp, _, _ = run(model, ps, sps, overlap=False, new_tokens=new)
    got, got_lp, s, depth = run(model, ps, sps, overlap=True, new_tokens=new, spec=SUFFIX)
    assert got == want
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=1e-5)
    return s, depth


def test_suffix_steps_run_device_fed_with_plain_decodings_tokens_and_logprobs(model):
    s, depth = suffix_equals_plain_decoding(model, 4, 16)
    assert s.runner.spec.fed_steps > 0 and depth == 2


def test_suffix_chains_with_chunked_prefill_preemption_and_prefix_caching(model):
    ps = repetitive(6) + repetitive(2)
    sps = greedy_and_seeded(8)
    want, _, _, _ = run(model, ps, sps, overlap=True, new_tokens=20, num_blocks=64, budget=16)
    got, _, s, _ = run(model, ps, sps, overlap=True, new_tokens=20, num_blocks=14, budget=16,
                       prefix_caching=True, spec=SUFFIX)
    assert s.num_preemptions > 0
    assert got == want
    assert s.runner.spec.fed_steps > 0


def test_smollm2_copying_a_passage_accepts_most_suffix_chain_drafts_in_overlapped_steps(smollm2_dir):
    """Greedy copying: the chain proposed while a step runs holds whenever that step accepted all
    its drafts, so most fed steps draft, most drafts are accepted, and two steps stay in flight."""
    from tokenizers import Tokenizer
    smol = load_model(smollm2_dir)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    passage = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step."
    prompt = tok.encode(f"<|im_start|>user\nRepeat exactly: {passage}<|im_end|>\n<|im_start|>assistant\n").ids
    sps = [pb.common.SamplingParams(ignore_eos=True, logprobs=1)]
    want, want_lp, _, _ = run(smol, [prompt], sps, overlap=False, new_tokens=24, num_blocks=32)
    got, got_lp, s, depth = run(smol, [prompt], sps, overlap=True, new_tokens=24, num_blocks=32, spec=SUFFIX)
    assert got == want
    assert got_lp["r0"] == pytest.approx(want_lp["r0"], abs=1e-4)
    d = s.runner.spec
    assert d.fed_steps > 0 and depth == 2
    assert d.drafted >= 12 and d.accepted / d.drafted > 0.5, (d.drafted, d.accepted)


def test_chains_through_the_executors_stride_q_layout_give_plain_decodings_tokens(model, monkeypatch):
    """gpu_fed.run_fed with chains (the GPU path, under the interpreter), at seeded random widths."""
    pytest.importorskip("triton")
    picked = random_widths(monkeypatch, 8)
    # Two at a time, the last two repeating the first two (greedy): the shared store of finished
    # outputs gives their chains.
    ps, sps = repetitive(2) * 2, [pb.common.SamplingParams(ignore_eos=True)] * 4
    want, _, _, _ = run(model, ps, sps, overlap=False, new_tokens=8, max_seqs=2)
    got, _, s, depth = run(model, ps, sps, overlap=True, new_tokens=8, spec=SUFFIX, max_seqs=2,
                           executor=_executor(model))
    assert got == want and depth == 2
    assert max(picked) > 1 and s.runner.spec.fed_steps > 0 and s.runner.spec.drafted > 0


def test_kernels_that_fail_to_build_leave_speculation_on_the_host_path(model, monkeypatch):
    """A feed/commit kernel that cannot be compiled at start-up (a driver or Triton problem) turns
    device-fed steps off instead of stopping the worker."""
    pytest.importorskip("triton")
    import services.worker.gpu_fed as gpu_fed
    from services.worker.gpu_exec import GpuExecutor
    from services.worker.runner import ModelRunner
    from services.worker.spec.decoder import SpecDecoder
    from tests.overlap_driver import BLOCK

    def broken(*a, **k):
        raise RuntimeError("no kernel today")
    monkeypatch.setattr(gpu_fed, "warm_up", broken)
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=16, block_size=BLOCK)
    runner.hello(BLOCK)
    runner.gpu = GpuExecutor(model, runner.kv_caches, BLOCK, max_num_tokens=64, max_num_seqs=8, graph_sizes=None)
    runner.enable_spec(SpecDecoder(SUFFIX))
    assert runner.spec is not None and runner.spec.device is None


def test_chains_are_on_unless_the_flag_turns_them_off(monkeypatch):
    from services.worker.spec.device_steps import chains_enabled
    monkeypatch.delenv("MESHLLM_DEVICE_CHAINS", raising=False)
    assert chains_enabled()
    monkeypatch.setenv("MESHLLM_DEVICE_CHAINS", "0")
    assert not chains_enabled()


def test_chains_take_the_host_path_where_it_measured_faster():
    """host_path_pays: nothing until fed steps of the width are measured; then one probe step for
    the host path (the same answer for every ask of that step, then none for HOST_PROBE_EVERY
    steps); once both are measured, the faster one in tokens a second; a fixed table, never."""
    from services.worker.spec.decoder import PERIOD_REVISIT, SpecDecoder
    from services.worker.spec.device_steps import HOST_PROBE_EVERY, host_path_pays
    spec = SpecDecoder(SUFFIX)
    rows = [("r0", 4, 100)]
    spec.acceptance.update("r0", 8, 6)
    assert not host_path_pays(spec, rows, 1, 5), "fed steps of width 5 not measured"
    spec.step_period(1, 5, 2e-3)
    assert host_path_pays(spec, rows, 1, 5) and host_path_pays(spec, rows, 1, 5), "the probe step"
    for _ in range(HOST_PROBE_EVERY - 1):
        spec.acceptance.tick()
        assert not host_path_pays(spec, rows, 1, 5)
    # The probe: a host speculating step of one row that accepted 2 drafts in 1 ms (3,000 tok/s)
    # against fed steps of 2 ms expected to emit 1 + (at most 4 * 0.75 ...) < 6 tokens.
    spec.step_period(1, 0, 1e-3)
    spec.host_spec_step(1, 2)
    assert host_path_pays(spec, rows, 1, 5)
    for _ in range(8):   # the host path got slower: towards 8 ms a step (375 tok/s; an EWMA)
        spec.step_period(1, 0, 8e-3)
        spec.host_spec_step(1, 2)
    assert not host_path_pays(spec, rows, 1, 5)
    for _ in range(PERIOD_REVISIT):
        spec.acceptance.tick()
    assert not host_path_pays(spec, rows, 1, 5), "fed period forgotten: a fed step measures it again"
    fixed = SpecDecoder(parse_spec_config({"method": "suffix", "num_speculative_tokens": 4,
                                           "dynamic_k": [[1, 64, 4]]}))
    fixed.step_period(1, 5, 2e-3)
    assert not host_path_pays(fixed, rows, 1, 5)


def test_chains_switching_to_the_host_path_and_back_give_plain_decodings_tokens(model, monkeypatch):
    """Whatever host_path_pays answers step after step (here a seeded random answer), suffix
    steps alternate between device-fed and host-verified ones with plain decoding's tokens."""
    import services.worker.spec.device_steps as device_steps
    rng = random.Random(5)
    answers: list[bool] = []

    def pays(spec, rows, n, width):
        answers.append(rng.random() < 0.4)
        return answers[-1]
    monkeypatch.setattr(device_steps, "host_path_pays", pays)
    s, _ = suffix_equals_plain_decoding(model, 4, 20)
    assert True in answers and False in answers and s.runner.spec.fed_steps > 0
