"""The public gRPC API and health through generated stubs."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import pb


def test_generate_streams_text_and_ends_with_usage(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        req = pb.generation.GenerateRequest(model=mesh.model_name, text="The sun rises in the",
                                            sampling=pb.common.SamplingParams(max_tokens=12, ignore_eos=True))
        responses = list(stub.Generate(req, timeout=120))
    assert len(responses) > 1
    last = responses[-1]
    assert last.finish_reason == pb.common.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 12 == last.usage.completion_tokens
    assert last.usage.prompt_tokens > 0
    assert "".join(r.text for r in responses).strip()
    assert len({r.request_id for r in responses}) == 1


def test_chat_input_list_models_and_tokenize(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        models = stub.ListModels(pb.generation.ListModelsRequest(), timeout=30)
        assert [m.id for m in models.models] == [mesh.model_name, "all-minilm-l6-v2"]
        assert models.models[0].max_model_len == 2048
        tok = stub.Tokenize(pb.generation.TokenizeRequest(model=mesh.model_name, text="hello world"), timeout=30)
        assert tok.count == len(tok.token_ids) > 0
        chat = pb.generation.ChatInput(messages=[pb.common.ChatMessage(role="user", content="Hi!")],
                                       add_generation_prompt=True)
        out = list(stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, chat=chat, sampling=pb.common.SamplingParams(max_tokens=8)), timeout=120))
        assert out[-1].finish_reason in (pb.common.FINISH_REASON_STOP, pb.common.FINISH_REASON_LENGTH)


def test_every_service_reports_serving_over_grpc_health(mesh):
    addrs = mesh.services()
    targets = {"gateway": mesh.grpc_addr, "tokenizer": addrs["tokenizer"], "scheduler": addrs["scheduler"],
               "worker": addrs["worker-health"]}
    for name, addr in targets.items():
        with grpc.insecure_channel(addr) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", name):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, (name, service)


def test_gateway_health_thread_reports_ready_with_its_reason(mesh):
    # The supervisor probes this port: it is answered from threads of its own, not the
    # event loop that carries request traffic.
    addr = mesh.services()["gateway-health"]
    with grpc.insecure_channel(addr) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "gateway", "meshllm.v1.Generation"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
        status = pb.health_grpc.StatusStub(ch).GetStatus(pb.health.StatusRequest(), timeout=10)
        assert status.state == pb.health.SERVING_STATE_READY and status.reason == "ready"
