"""Every service's gRPC server answers a request it cannot decode (corrupt protobuf, invalid UTF-8
in a string field) with INVALID_ARGUMENT and a plain message, on unary, server-streaming and
bidirectional calls alike, and keeps serving (real server and sockets)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2 as hpb

from services.common import pb
from services.common.grpc_server import bind, make_server

CORRUPT = b"\xff\xff\xff"
BAD_UTF8 = b"\x0a\x03\xff\xfe\xfd"   # field 1 (a string) holding three bytes that are not UTF-8
RAW = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)


async def _echo_stream(requests, context):
    async for message in requests:            # a bidi handler that trusts what it is given
        yield pb.common.ChatMessage(role=message.role.upper())


async def _exercise() -> dict:
    server, health = make_server("guardtest", [])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
        "Chat": grpc.stream_stream_rpc_method_handler(
            _echo_stream, request_deserializer=pb.common.ChatMessage.FromString,
            response_serializer=pb.common.ChatMessage.SerializeToString)}),))
    port = bind(server, "127.0.0.1:0")
    await server.start()
    seen: dict = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check", **RAW)
            for name, payload in (("corrupt", CORRUPT), ("utf8", BAD_UTF8)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await check(payload, timeout=5)
                seen[name] = (err.value.code(), err.value.details())
            watch = ch.unary_stream("/grpc.health.v1.Health/Watch", **RAW)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in watch(BAD_UTF8, timeout=5):
                    pass
            seen["server_stream"] = (err.value.code(), err.value.details())
            chat = ch.stream_stream("/test.Echo/Chat", **RAW)
            call = chat(timeout=5)
            await call.write(pb.common.ChatMessage(role="user").SerializeToString())
            seen["first_reply"] = pb.common.ChatMessage.FromString(await call.read()).role
            await call.write(BAD_UTF8)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            seen["bidi"] = (err.value.code(), err.value.details())
            ok = await check(hpb.HealthCheckRequest().SerializeToString(), timeout=5)
            seen["still_serving"] = hpb.HealthCheckResponse.FromString(ok).status == hpb.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    return seen


def test_undecodable_requests_are_invalid_argument_with_a_plain_message():
    seen = asyncio.run(_exercise())
    for key in ("corrupt", "utf8", "server_stream", "bidi"):
        code, details = seen[key]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, key
        assert "is not a valid" in details and "Error" not in details and "<class" not in details, details
    assert "grpc.health.v1.HealthCheckRequest" in seen["utf8"][1]
    assert "meshllm.v1.ChatMessage" in seen["bidi"][1]
    assert seen["first_reply"] == "USER"       # good messages before the bad one were served
    assert seen["still_serving"]
