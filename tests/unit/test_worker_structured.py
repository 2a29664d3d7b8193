"""Structured outputs on the worker (services/worker/structured.py): SmolLM2 on the CPU, driven
through the wire edge with handmade plans like the engine drives it. Constrained outputs end with
EOS where the grammar completes and match it; unconstrained neighbours are untouched; a constraint
that cannot be enforced ends only its own request."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from services.common import pb
from services.worker.models import load_model
from services.worker.plan import SamplingConfig
from services.worker.runner import ModelRunner
from services.worker.sampling import SampleRow, apply_bitmask
from services.worker.wire import ProtoRunner, sampling_from_proto
from tests.worker_driver import MiniScheduler

BLOCK = 16
NUM_BLOCKS = 64
EOS = 2    # SmolLM2's

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class StopScheduler(MiniScheduler):
    """MiniScheduler that also finishes a request on EOS, as the real scheduler does."""

    def step(self):
        result = super().step()
        for r in list(self.running):
            if r.outputs and r.outputs[-1] == EOS:
                self.results[r.rid] = r.outputs
                self.running.remove(r)
                self.free += r.blocks
                self.finished.append(r.rid)
        return result


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return load_model(smollm2_dir), Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture
def runner(smol, smollm2_dir):
    r = ModelRunner(smol[0], model_name="smol", kv_cache_bytes=0, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                    tokenizer_path=str(smollm2_dir / "tokenizer.json"))
    r.hello(BLOCK)
    return r


def sampling(**structured) -> pb.common.SamplingParams:
    return pb.common.SamplingParams(structured=pb.common.StructuredOutput(**structured))


def run(runner, tok, reqs: dict, max_new: int = 48, budget: int = 256) -> dict[str, list[int]]:
    sched = StopScheduler(ProtoRunner(runner).execute, BLOCK, NUM_BLOCKS, budget=budget)
    for rid, (text, sp) in reqs.items():
        sched.add(rid, tok.encode(text).ids, max_new, sp)
    out = sched.run()
    assert runner.requests == {}, "finished requests (and their matchers) must be dropped"
    return out


def text_of(tok, ids: list[int]) -> str:
    assert ids[-1] == EOS, "the output must end where the grammar completes"
    return tok.decode(ids[:-1])


def test_json_schema_greedy_output_validates_and_ends_with_eos(runner, smol):
    _, tok = smol
    out = run(runner, tok, {"j": ("A person as JSON:", sampling(json_schema=json.dumps(SCHEMA)))})
    jsonschema.validate(json.loads(text_of(tok, out["j"])), SCHEMA)


def test_regex_and_choice_outputs_match_their_constraint(runner, smol):
    _, tok = smol
    choices = ["red", "green", "blue"]
    out = run(runner, tok, {"re": ("A part number:", sampling(regex=r"[A-Z]{2}-[0-9]{3}")),
                            "ch": ("My favourite colour is", sampling(choice=pb.common.ChoiceList(choices=choices))),
                            "obj": ("Some JSON:", sampling(json_object=True))})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text_of(tok, out["re"]))
    assert text_of(tok, out["ch"]) in choices
    assert isinstance(json.loads(text_of(tok, out["obj"])), dict)


def test_unconstrained_request_in_the_batch_is_unchanged(runner, smol):
    _, tok = smol
    free = ("The capital of France is", pb.common.SamplingParams())
    alone = run(runner, tok, {"free": free}, max_new=12)
    mixed = run(runner, tok, {"free": free, "j": ("JSON:", sampling(json_schema=json.dumps(SCHEMA))),
                              "re": ("Code:", sampling(regex="[0-9]{4}"))}, max_new=12)
    assert mixed["free"] == alone["free"]


def test_seeded_temperature_sampling_still_validates(runner, smol):
    _, tok = smol
    sp = sampling(json_schema=json.dumps(SCHEMA))
    sp.temperature, sp.seed = 1.0, 1234
    out = run(runner, tok, {"t": ("A person as JSON:", sp)}, max_new=64)
    jsonschema.validate(json.loads(text_of(tok, out["t"])), SCHEMA)
    assert run(runner, tok, {"t": ("A person as JSON:", sp)}, max_new=64) == out, "seeded: reproducible"


def test_a_constraint_that_does_not_build_ends_only_its_own_request(runner, smol, caplog):
    _, tok = smol
    free = ("The capital of France is", pb.common.SamplingParams())
    alone = run(runner, tok, {"free": free}, max_new=8)
    bad = sampling(grammar="start: %%% not lark")      # the gateway would refuse it; here it slipped by
    assert sampling_from_proto(bad, 49152).structured[0] == "grammar"
    with caplog.at_level("WARNING"):
        out = run(runner, tok, {"free": free, "bad": ("Hello", bad)}, max_new=8)
    assert out["bad"] == [EOS]                        # ended at once, with "stop"
    assert out["free"] == alone["free"]
    assert "request bad" in caplog.text and "%%%" not in caplog.text, "id logged, never the grammar"


def test_preempted_constrained_request_resumes_with_the_same_output(runner, smol):
    _, tok = smol
    sp = sampling(json_schema=json.dumps(SCHEMA))
    want = run(runner, tok, {"j": ("A person as JSON:", sp)})["j"]
    sched = StopScheduler(ProtoRunner(runner).execute, BLOCK, NUM_BLOCKS, budget=256)
    sched.add("j", tok.encode("A person as JSON:").ids, 48, sp)
    for _ in range(5):
        sched.step()
    sched.preempt("j")        # back as a NewRequest with 4 outputs: its new matcher is fed them
    assert sched.run()["j"] == want


def test_grammar_wins_over_min_tokens_once_it_is_complete(runner, smol):
    _, tok = smol
    sp = sampling(choice=pb.common.ChoiceList(choices=["yes", "no"]))
    sp.min_tokens = 10
    out = run(runner, tok, {"c": ("Is the sky blue? Answer:", sp)}, max_new=16)
    assert text_of(tok, out["c"]) in ("yes", "no") and len(out["c"]) < 10


def test_bitmask_refuses_unset_bits_and_the_padded_vocabulary():
    rows = [SampleRow(SamplingConfig(), [], 0, 0, mask_row=0), SampleRow(SamplingConfig(), [], 0, 0)]
    bitmask = torch.zeros(1, 2, dtype=torch.int32)        # a 64-token tokenizer under a 70-logit model
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = -(1 << 31)                            # bit 31 of word 1: token 63
    logits = torch.zeros(2, 70)
    apply_bitmask(logits, rows, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, 63]
    assert torch.isfinite(logits[1]).all(), "an unconstrained row is untouched"


def test_matcher_builds_and_masks_are_measured(runner, smol):
    from prometheus_client import REGISTRY
    _, tok = smol
    count = lambda name: REGISTRY.get_sample_value(name + "_count", {"model_name": "smol"}) or 0.0  # noqa: E731
    before = (count("meshllm:worker_structured_matcher_build_seconds"),
              count("meshllm:worker_structured_mask_seconds_per_row"))
    schema = dict(SCHEMA, title="measured")               # a grammar not in the template cache yet
    out = run(runner, tok, {"j": ("JSON:", sampling(json_schema=json.dumps(schema)))})
    assert count("meshllm:worker_structured_matcher_build_seconds") == before[0] + 1
    assert count("meshllm:worker_structured_mask_seconds_per_row") == before[1] + len(out["j"])


def test_overlapped_steps_give_the_synchronous_constrained_tokens(smol, smollm2_dir):
    """The engine's pipelined order (submit N+1, then collect N) with grammar masks: the next
    forward starts before the previous step's tokens are read (no added sync), the masks are
    computed after, and the tokens are exactly the synchronous runner's."""
    from tests.overlap_driver import prompts, run as run_pipelined
    from tests.unit.test_worker_overlap import forward_watch
    schema = sampling(json_schema=json.dumps(SCHEMA))
    regex = sampling(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}")
    penalised = sampling(json_object=True)
    penalised.repetition_penalty = 1.2
    free = pb.common.SamplingParams(temperature=0.8, seed=4)
    sps = [schema, regex, penalised, free]
    for sp in sps:
        sp.ignore_eos = True
    ps = prompts(4, 49152)
    path = str(smollm2_dir / "tokenizer.json")
    want, _, _, _ = run_pipelined(smol[0], ps, sps, overlap=False, tokenizer_path=path)
    unread: list[int] = []
    got, _, _, _ = run_pipelined(smol[0], ps, sps, overlap=True, tokenizer_path=path, watch=forward_watch(unread))
    assert got == want
    assert max(unread) == 1, "a constrained decode forward should not wait for the previous step's tokens"
    assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}", smol[1].decode([t for t in got["r1"] if t != EOS]))


def test_grammars_compile_on_the_build_thread_and_a_stuck_build_ends_only_its_request(smollm2_dir, monkeypatch):
    """start() only enqueues the build (the engine thread goes on); the first use waits for it,
    at most BUILD_WAIT_S; a repeated grammar is a cache hit."""
    import threading

    from prometheus_client import REGISTRY

    from services.common import structured as common
    from services.worker import structured as worker_structured
    cons = worker_structured.Constraints(str(smollm2_dir / "tokenizer.json"), (EOS,), 49152, model_name="build")
    cons.warm().result(timeout=30)
    grammar = ("json_schema", common.grammar_of(pb.common.StructuredOutput(json_schema=json.dumps(SCHEMA))))
    gate = threading.Event()
    cons._submit(gate.wait)                              # the build thread is busy
    rm = cons.start("a", grammar, [])
    assert not rm.ready, "start() must not build on the calling thread"
    gate.set()
    assert rm.matcher is not None and not rm.failed
    hits = lambda: REGISTRY.get_sample_value("meshllm:worker_structured_grammar_cache_total",  # noqa: E731
                                             {"model_name": "build", "result": "hit"}) or 0.0
    before = hits()
    assert cons.start("b", grammar, []).matcher is not None
    assert hits() == before + 1 and cons.cache_hits == 1
    monkeypatch.setattr(worker_structured, "BUILD_WAIT_S", 0.05)
    gate.clear()
    cons._submit(gate.wait)
    stuck = cons.start("c", grammar, [])
    assert stuck.matcher is None and stuck.failed, "a build past the bound ends its request (EOS mask)"
    gate.set()


def test_parallel_mask_fill_gives_the_serial_masks(smollm2_dir, monkeypatch):
    """Rows filled by llguidance's thread pool (chosen for expensive grammars) equal the rows
    filled one by one."""
    from services.common import structured as common
    from services.worker import structured as worker_structured
    cons = worker_structured.Constraints(str(smollm2_dir / "tokenizer.json"), (EOS,), 49152, model_name="par")
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    grammars = [common.grammar_of(pb.common.StructuredOutput(json_schema=json.dumps(SCHEMA))),
                common.grammar_of(pb.common.StructuredOutput(regex=r"[a-z]+-[0-9]{2}")),
                common.grammar_of(pb.common.StructuredOutput(json_object=True))]
    prefixes = ['{"name": "Al', "abc", '{"a": [1, 2']

    def masks(parallel: bool) -> torch.Tensor:
        monkeypatch.setattr(worker_structured, "PARALLEL_MIN_ROWS", 1 if parallel else 10**9)
        monkeypatch.setattr(worker_structured, "PARALLEL_MIN_MS", 0.0)
        ms = [cons.start(f"r{i}", (f"k{i % 3}", grammars[i % 3]), tok.encode(prefixes[i % 3]).ids)
              for i in range(6)]
        rows = [SampleRow(SamplingConfig(), [], 0, 0) for _ in ms]
        return cons.prepare(rows, ms)

    serial, parallel = masks(False), masks(True)
    import numpy as np
    allowed = np.unpackbits(serial.numpy().view(np.uint8), axis=1).sum(axis=1)
    assert serial.shape == (6, 49152 // 32) and (allowed > 1).all(), "every row a live grammar, not EOS-only"
    assert torch.equal(serial, parallel)
