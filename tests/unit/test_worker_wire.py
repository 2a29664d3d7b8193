"""The worker's wire edge (services/worker/wire.py): step.proto bytes <-> the worker's values, and
the error replies the engine gives for bytes it cannot run."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import pb
from services.worker import wire
from services.worker.config import WorkerConfig
from services.worker.engine import Engine
from services.worker.plan import (INTERNAL, INVALID_ARGUMENT, Hello, SampledOutput, StepPlan, StepResult,
                                  TokenLogprob, TraceContext, WorkerInfo)
from services.worker.simulated import SimSpec, SimulatedRunner

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1000
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def request_bytes(plan: pb.step.StepPlan) -> bytes:
    return pb.step.WorkerRequest(plan=plan).SerializeToString()


def test_plan_with_new_cached_and_finished_requests_survives_the_wire():
    msg = pb.step.StepPlan(step_id=41, finished_ids=["gone", "preempted"])
    msg.new_requests.add(request_id="traced", token_ids=[5, 6, 7, 8], block_ids=[3, 9], num_computed_tokens=1,
                         num_scheduled_tokens=3, num_output_tokens=1,
                         sampling=pb.common.SamplingParams(temperature=0.7, top_p=0.9, seed=5, logprobs=2,
                                                           logit_bias={11: -1.5}, stop_token_ids=[4, VOCAB + 9]),
                         trace=pb.common.TraceContext(traceparent=TRACEPARENT, tracestate="k=v"))
    msg.new_requests.add(request_id="plain", token_ids=[1], block_ids=[0], num_scheduled_tokens=1)
    msg.cached_requests.add(request_id="grows", new_block_ids=[12, 13], num_computed_tokens=30,
                            num_scheduled_tokens=2)
    msg.cached_requests.add(request_id="decodes", num_computed_tokens=7, num_scheduled_tokens=1)
    plan = wire.request_from_bytes(request_bytes(msg), VOCAB)
    assert isinstance(plan, StepPlan) and not plan.invalid
    assert (plan.step_id, plan.finished_ids) == (41, ["gone", "preempted"])
    traced, plain = plan.new_requests
    assert (traced.request_id, traced.token_ids, traced.block_ids) == ("traced", [5, 6, 7, 8], [3, 9])
    assert (traced.num_computed_tokens, traced.num_scheduled_tokens, traced.num_output_tokens) == (1, 3, 1)
    assert traced.trace == TraceContext(TRACEPARENT, "k=v")
    sp = traced.sampling
    assert (sp.temperature, sp.seed, sp.logprobs) == (pytest.approx(0.7), 5, 2) and sp.top_p == pytest.approx(0.9)
    assert sp.logit_bias == ((11, -1.5),) and sp.stop_token_ids == (4,)   # ids outside the vocabulary dropped
    assert plain.trace is None and plain.sampling.greedy and plain.sampling.logprobs is None
    grows, decodes = plan.cached_requests
    assert (grows.request_id, grows.new_block_ids, grows.num_computed_tokens, grows.num_scheduled_tokens) == \
        ("grows", [12, 13], 30, 2)
    assert (decodes.request_id, decodes.new_block_ids, decodes.num_computed_tokens) == ("decodes", [], 7)
    hello = wire.request_from_bytes(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=32))
                                    .SerializeToString(), VOCAB)
    assert hello == Hello(32)


def test_bad_sampling_marks_the_plan_invalid_without_requests():
    msg = pb.step.StepPlan(step_id=3, finished_ids=["x"])
    msg.new_requests.add(request_id="ok", token_ids=[1], block_ids=[0], num_scheduled_tokens=1)
    msg.new_requests.add(request_id="hot", token_ids=[1], block_ids=[1], num_scheduled_tokens=1,
                         sampling=pb.common.SamplingParams(temperature=float("nan")))
    plan = wire.plan_from_proto(msg, VOCAB)
    assert plan.step_id == 3 and plan.invalid == "request hot: temperature must be a finite number, got nan"
    assert plan.new_requests == plan.cached_requests == plan.finished_ids == []


def test_result_with_logprobs_and_a_failed_result_encode_to_step_results():
    ok = StepResult(7, [SampledOutput("chunk", [], []),
                        SampledOutput("lp", [42], [TokenLogprob(42, -0.25, [(42, -0.25), (9, -1.5)])]),
                        SampledOutput("plain", [8], [])], forward_ns=1234)
    reply = pb.step.WorkerReply.FromString(wire.result_reply(ok))
    res = reply.result
    assert reply.WhichOneof("kind") == "result" and not res.HasField("error")
    assert (res.step_id, res.forward_ns) == (7, 1234)
    assert [(o.request_id, list(o.token_ids)) for o in res.outputs] == [("chunk", []), ("lp", [42]), ("plain", [8])]
    (lp,) = res.outputs[1].logprobs
    assert (lp.token_id, lp.logprob) == (42, -0.25)
    assert [(t.token_id, t.logprob) for t in lp.top] == [(42, -0.25), (9, -1.5)]
    assert not res.outputs[0].logprobs and not res.outputs[2].logprobs
    assert wire.result_to_proto(ok) == res
    for code, want in ((INVALID_ARGUMENT, pb.common.ERROR_CODE_INVALID_ARGUMENT),
                       (INTERNAL, pb.common.ERROR_CODE_INTERNAL)):
        bad = pb.step.WorkerReply.FromString(wire.result_reply(StepResult.failed(9, code, "why"))).result
        assert (bad.step_id, bad.error.code, bad.error.message, len(bad.outputs)) == (9, want, "why", 0)
    # An empty step (only finished ids) still answers with a result, not an empty reply.
    empty = pb.step.WorkerReply.FromString(wire.result_reply(StepResult(0, [])))
    assert empty.WhichOneof("kind") == "result"


def test_worker_info_encodes_every_field():
    info = WorkerInfo(100, 16, 2048, VOCAB, (2, 3), "tiny", "cpu")
    got = pb.step.WorkerReply.FromString(wire.info_reply(info)).info
    assert (got.num_kv_blocks, got.block_size, got.max_model_len, got.vocab_size) == (100, 16, 2048, VOCAB)
    assert (list(got.eos_token_ids), got.model_name, got.device) == ([2, 3], "tiny", "cpu")


@pytest.fixture
def engine(tmp_path):
    """The engine (no socket: `handle` is the path of a tensor-parallel follower and of every
    unpipelined request) over a simulated runner."""
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": VOCAB, "eos_token_id": 2, "max_position_embeddings": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    cfg = WorkerConfig(model=str(tmp_path), zmq_addr="ipc:///tmp/wire-test-never-bound.ipc", simulate=True)
    spec = SimSpec.from_model_dir(cfg.model)
    e = Engine(cfg, None, lambda: SimulatedRunner(spec, model_name="sim", kv_cache_bytes=1 << 20))
    e.load()
    return e


def reply(engine: Engine, payload: bytes) -> pb.step.WorkerReply:
    return pb.step.WorkerReply.FromString(engine.handle(payload))


def test_undecodable_and_empty_requests_get_one_line_error_replies(engine):
    for payload, message in ((b"\xff\x00not a protobuf", "undecodable WorkerRequest"),
                             (b"", "empty WorkerRequest")):
        r = reply(engine, payload)
        assert r.result.error.code == pb.common.ERROR_CODE_INVALID_ARGUMENT
        assert r.result.error.message == message and r.result.step_id == 0 and not r.result.outputs
    assert reply(engine, pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=16))
                 .SerializeToString()).info.vocab_size == VOCAB


def test_a_plan_with_bad_sampling_is_rejected_in_its_step_and_changes_nothing(engine):
    engine.handle(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=16)).SerializeToString())
    good = pb.step.StepPlan(step_id=1)
    good.new_requests.add(request_id="a", token_ids=[5, 6], block_ids=[0], num_scheduled_tokens=2)
    assert len(reply(engine, request_bytes(good)).result.outputs[0].token_ids) == 1
    bad = pb.step.StepPlan(step_id=2, finished_ids=["a"])
    bad.new_requests.add(request_id="b", token_ids=[5], block_ids=[1], num_scheduled_tokens=1,
                         sampling=pb.common.SamplingParams(logit_bias={VOCAB + 1: 1.0}))
    res = reply(engine, request_bytes(bad)).result
    assert (res.step_id, res.error.code) == (2, pb.common.ERROR_CODE_INVALID_ARGUMENT)
    assert res.error.message == f"request b: logit_bias has token id {VOCAB + 1}, outside the vocabulary [0, {VOCAB})"
    assert set(engine.runner.requests) == {"a"}   # its finished id was not applied either


def test_the_compute_rooms_read_no_protobuf_and_the_simulated_worker_loads_no_torch():
    rooms = [ROOT / "services/worker" / f for f in ("runner.py", "sampling.py", "gpu_exec.py", "attention.py",
                                                    "plan.py", "engine.py", "simulated.py", "step_tracing.py")]
    rooms += sorted((ROOT / "services/worker/models").glob("*.py")) + sorted((ROOT / "services/worker/kernels").glob("*.py"))
    for path in rooms:
        assert not re.search(r"^from services\.common import .*\bpb\b|^import .*protobuf|^from google\.protobuf",
                             path.read_text(), re.M), path
    code = ("import sys, services.worker.engine, services.worker.simulated, services.worker.wire; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
