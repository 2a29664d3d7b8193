"""Speculative decoding end to end in the worker and the scheduler core (n-gram and suffix
proposers), driven like the engine with async scheduling on (two steps in flight) and off:
outputs, seeded samples and logprobs are exactly those of plain decoding, with chunked
prefill, preemptions, prefix caching, penalties and grammar masks; nothing past max_tokens."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from services.common import pb  # noqa: E402
from services.common.spec_config import parse_spec_config  # noqa: E402
from services.worker.models import load_model  # noqa: E402
from tests.overlap_driver import run  # noqa: E402
from tests.unit.tiny_llama import VOCAB, make_tiny_llama  # noqa: E402

NGRAM = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3})
SUFFIX = parse_spec_config({"method": "suffix", "num_speculative_tokens": 3, "suffix_min_prob": 0.0})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_llama(tmp_path_factory.mktemp("tiny-spec"), seed=7))


def repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat a short pattern: n-gram lookup finds continuations in them."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        pat = torch.randint(4, VOCAB, (3 + i % 3,), generator=g).tolist()
        out.append((pat * 4)[: 8 + i])
    return out


def mix(i: int) -> pb.common.SamplingParams:
    kind = i % 4
    if kind == 0:
        return pb.common.SamplingParams(ignore_eos=True)
    if kind == 1:
        return pb.common.SamplingParams(temperature=0.8, top_p=0.9, seed=50 + i, ignore_eos=True, logprobs=2)
    if kind == 2:
        return pb.common.SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, ignore_eos=True)
    return pb.common.SamplingParams(temperature=1.0, seed=9 + i, ignore_eos=True)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_speculation_gives_plain_decodings_tokens_and_logprobs(model, spec, overlap):
    ps, sps = repetitive(6), [mix(i) for i in range(6)]
    want, want_lp, _, _ = run(model, ps, sps, overlap=overlap, new_tokens=24)
    got, got_lp, s, _ = run(model, ps, sps, overlap=overlap, new_tokens=24, spec=spec)
    assert got == want
    assert all(len(v) == 24 for v in got.values()), "exactly max_tokens, never one past"
    for rid in want_lp:
        assert got_lp[rid] == pytest.approx(want_lp[rid], abs=1e-5)
    assert s.runner.spec.drafted > 0, "drafts were verified"


def test_speculation_with_chunked_prefill_preemption_and_prefix_caching(model):
    ps = repetitive(6) + repetitive(2)      # the last two repeat earlier prompts: prefix-cache hits
    sps = [mix(i) for i in range(8)]
    want, _, _, _ = run(model, ps, sps, overlap=True, new_tokens=20, num_blocks=64, budget=16)
    got, _, s, _ = run(model, ps, sps, overlap=True, new_tokens=20, num_blocks=14, budget=16,
                       prefix_caching=True, spec=NGRAM)
    assert s.num_preemptions > 0
    assert got == want
    assert s.runner.spec.drafted > 0


def test_a_dynamic_k_table_of_zero_turns_speculation_off(model):
    off = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": [[1, 64, 0]]})
    ps, sps = repetitive(3), [mix(0)] * 3
    want, _, _, _ = run(model, ps, sps, overlap=True, new_tokens=12)
    got, _, s, depth = run(model, ps, sps, overlap=True, new_tokens=12, spec=off)
    assert got == want and s.runner.spec.drafted == 0
    assert depth == 2, "no drafts: steps keep their overlap"


def test_smollm2_repeating_a_passage_accepts_most_drafts_with_the_same_text(smollm2_dir):
    """A real model asked to copy text: n-gram drafts from the prompt are mostly right, and the
    greedy output is plain decoding's, in fewer steps."""
    from tokenizers import Tokenizer
    smol = load_model(smollm2_dir)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    passage = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step."
    prompt = tok.encode(f"<|im_start|>user\nRepeat exactly: {passage}<|im_end|>\n<|im_start|>assistant\n").ids
    spec = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    sp = [pb.common.SamplingParams(ignore_eos=True)]
    import tests.overlap_driver as driver
    want, _, _, _ = run(smol, [prompt], sp, overlap=False, new_tokens=24, num_blocks=16)
    steps = {}

    def count_steps(runner):
        submit = runner.submit

        def counted(plan):
            steps["n"] = steps.get("n", 0) + 1
            return submit(plan)
        runner.submit = counted
    got, _, s, _ = run(smol, [prompt], sp, overlap=False, new_tokens=24, num_blocks=16, spec=spec, watch=count_steps)
    assert got == want
    d = s.runner.spec
    assert d.drafted > 0 and d.accepted / d.drafted > 0.5, (d.drafted, d.accepted)
    assert steps["n"] < 24, "accepted drafts save steps"
    assert driver.BLOCK == 4


def test_grammar_masks_apply_to_every_verified_position_and_cut_bad_drafts(smollm2_dir):
    """Constrained requests with speculation: the output is plain (constrained) decoding's and
    follows the grammar; drafts the grammar refuses are cut before they are verified."""
    import json
    import re
    from tokenizers import Tokenizer
    smol = load_model(smollm2_dir)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    path = str(smollm2_dir / "tokenizer.json")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    prompt = tok.encode('Data: {"name": "Ann", "tags": ["a", "b"]} {"name": "Bob", "tags": ["c"]} Next:').ids
    sps = [pb.common.SamplingParams(structured=pb.common.StructuredOutput(json_schema=json.dumps(schema))),
           pb.common.SamplingParams(structured=pb.common.StructuredOutput(regex=r"(ab|cd){2,6}"))]
    spec = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    want, _, _, _ = run(smol, [prompt, prompt], sps, overlap=False, new_tokens=40, num_blocks=32, tokenizer_path=path)
    got, _, s, _ = run(smol, [prompt, prompt], sps, overlap=True, new_tokens=40, num_blocks=32, tokenizer_path=path,
                       spec=spec)
    assert got == want
    eos = 2
    text = tok.decode([t for t in got["r0"] if t != eos])
    json.loads(text)
    assert re.fullmatch(r"(ab|cd){2,6}", tok.decode([t for t in got["r1"] if t != eos]))
    assert s.runner.spec.drafted > 0
