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


def test_grpc_chat_json_fields_get_the_http_limits(mesh):
    """tools_json, chat_template_kwargs_json and tool_calls_json are held to what HTTP enforces on
    the same fields: nesting, size, tool count and shape, the tool-call parser requirement."""
    import json

    import pytest
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    user = pb.common.ChatMessage(role="user", content="Hi!")
    deep = "[" * 5000 + "]" * 5000
    cases = {
        "chat.tools_json": pb.generation.ChatInput(messages=[user], tools_json=deep),
        "chat.chat_template_kwargs_json": pb.generation.ChatInput(
            messages=[user], chat_template_kwargs_json='{"a": ' + deep + "}"),
        "chat.messages[1].tool_calls_json": pb.generation.ChatInput(messages=[
            user, pb.common.ChatMessage(role="assistant", tool_calls_json=deep)]),
        "at most 128 tools": pb.generation.ChatInput(messages=[user], tools_json=json.dumps([tool] * 1000)),
        "--tool-call-parser": pb.generation.ChatInput(messages=[user], tools_json=json.dumps([tool])),
        "is not valid JSON": pb.generation.ChatInput(messages=[user], chat_template_kwargs_json="{nope"),
    }
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        for words, chat in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.generation.GenerateRequest(
                    model=mesh.model_name, chat=chat, sampling=pb.common.SamplingParams(max_tokens=2)), timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, err.value.details())
            assert words in err.value.details(), err.value.details()
        # Tokenize only renders tools: no parser needed, the limits still hold.
        ok = stub.Tokenize(pb.generation.TokenizeRequest(model=mesh.model_name, chat=pb.generation.ChatInput(
            messages=[user], tools_json=json.dumps([tool]))), timeout=30)
        assert ok.count > 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(pb.generation.TokenizeRequest(model=mesh.model_name, chat=cases["chat.tools_json"]),
                          timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        out = list(stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text="Hello", sampling=pb.common.SamplingParams(max_tokens=2)), timeout=60))
        assert out[-1].usage.completion_tokens >= 1
