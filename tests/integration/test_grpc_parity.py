"""The public gRPC API has the HTTP API's parameters and validation: sampling, logprobs,
n, stop, Tokenize, ListModels, Abort and cancellation, through generated stubs."""
from __future__ import annotations


import grpc
import pytest

from services.common import pb
from tests.integration.test_lifecycle import scheduler_load, wait_idle


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        yield pb.generation_grpc.GenerationStub(ch)


def generate(stub, mesh, **kw):
    n = kw.pop("n", 0)
    rid = kw.pop("request_id", "")
    req = pb.generation.GenerateRequest(model=mesh.model_name, text="The quick brown fox", n=n,
                                        request_id=rid, sampling=pb.common.SamplingParams(**kw))
    return list(stub.Generate(req, timeout=120))


def test_generate_with_n_logprobs_and_seed(stub, mesh):
    out = generate(stub, mesh, n=2, max_tokens=5, temperature=1.0, seed=4, logprobs=2, ignore_eos=True)
    by_choice = {i: [r for r in out if r.index == i] for i in (0, 1)}
    assert set(r.index for r in out) == {0, 1}
    ids = [[t for r in rs for t in r.token_ids] for rs in by_choice.values()]
    assert all(len(x) == 5 for x in ids) and ids[0] != ids[1]
    for rs in by_choice.values():
        lps = [lp for r in rs for lp in r.logprobs]
        assert [lp.token_id for lp in lps] == [t for r in rs for t in r.token_ids]
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in lps)
        assert rs[-1].finish_reason == pb.common.FINISH_REASON_LENGTH and rs[-1].usage.completion_tokens == 5
    again = generate(stub, mesh, n=2, max_tokens=5, temperature=1.0, seed=4, ignore_eos=True)
    assert [[t for r in again if r.index == i for t in r.token_ids] for i in (0, 1)] == ids


def test_generate_stop_string_and_stop_token(stub, mesh):
    base = generate(stub, mesh, max_tokens=10, ignore_eos=True)
    text = "".join(r.text for r in base)
    ids = [t for r in base for t in r.token_ids]
    stop = text[4:7]
    cut = generate(stub, mesh, max_tokens=10, ignore_eos=True, stop=[stop])
    assert "".join(r.text for r in cut) == text[:text.index(stop)] and cut[-1].stop_reason == stop
    by_id = generate(stub, mesh, max_tokens=10, ignore_eos=True, stop_token_ids=[ids[2]])
    assert [t for r in by_id for t in r.token_ids] == ids[:ids.index(ids[2]) + 1]
    assert by_id[-1].finish_reason == pb.common.FINISH_REASON_STOP


@pytest.mark.parametrize("kw, needle", [({"n": 99}, "n must be"), ({"logprobs": 21}, "logprobs"),
                                        ({"top_p": 2.0}, "top_p"), ({"max_tokens": 5000}, "context length"),
                                        ({"logit_bias": {10 ** 6: 1.0}}, "logit_bias")])
def test_generate_validates_like_http(stub, mesh, kw, needle):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, mesh, **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()


def test_tokenize_list_models(stub, mesh):
    tok = stub.Tokenize(pb.generation.TokenizeRequest(model=mesh.model_name, text="a b c"), timeout=30)
    assert tok.count == len(tok.token_ids) > 0 and tok.max_model_len == 2048
    assert mesh.model_name in [m.id for m in stub.ListModels(pb.generation.ListModelsRequest(), timeout=30).models]


def test_abort_stops_a_running_generate_in_the_scheduler(stub, mesh):
    call = stub.Generate(pb.generation.GenerateRequest(
        model=mesh.model_name, text="Tell me a story", request_id="parity-abort-1",
        sampling=pb.common.SamplingParams(max_tokens=1500, ignore_eos=True)), timeout=120)
    next(call)
    assert scheduler_load(mesh).num_running == 1
    assert stub.Abort(pb.generation.AbortRequest(request_ids=["parity-abort-1", "unknown"]), timeout=30).aborted == 1
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert wait_idle(mesh) < 5.0


def test_cancelling_an_n_stream_aborts_every_choice(stub, mesh):
    call = stub.Generate(pb.generation.GenerateRequest(
        model=mesh.model_name, text="Tell me a story", n=3,
        sampling=pb.common.SamplingParams(max_tokens=1500, ignore_eos=True)), timeout=120)
    next(call)
    assert scheduler_load(mesh).num_running == 3
    call.cancel()
    assert wait_idle(mesh) < 5.0
