"""A server span per unary gRPC call of the mesh's per-request RPCs, parented by the
caller's `traceparent` metadata (the gateway sends it for sampled requests only).

Installed by make_server only while tracing is on; calls without a sampled traceparent
(health checks, an untraced request) pass straight through.
"""
from __future__ import annotations

import grpc

from services.common import telemetry

# Full method -> span name. Only these are traced: they run once per request.
SPAN_NAMES = {
    "/meshllm.v1.Tokenizer/Encode": "tokenizer.encode",
    "/meshllm.v1.Tokenizer/ApplyChatTemplate": "tokenizer.chat_template",
    "/meshllm.v1.Tokenizer/Decode": "tokenizer.decode",
    "/meshllm.v1.Embedder/Embed": "embedder.embed",
}


def tracing_interceptors() -> list:
    return [TracingServerInterceptor()] if telemetry.ENABLED else []


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        name = SPAN_NAMES.get(handler_call_details.method)
        if name is None or handler is None or handler.unary_unary is None or not telemetry.ENABLED:
            return handler
        tp, ts = telemetry.traceparent_from_metadata(handler_call_details.invocation_metadata)
        if not tp:
            return handler
        behavior = handler.unary_unary
        method = handler_call_details.method

        async def traced(request, context):
            span = telemetry.start_span(name, traceparent=tp, tracestate=ts, kind="server",
                                        attributes={"rpc.system": "grpc", "rpc.method": method})
            if span is None:  # the caller did not sample this request
                return await behavior(request, context)
            token = telemetry.attach(span)
            error = None
            try:
                return await behavior(request, context)
            except BaseException as err:
                code = context.code() if hasattr(context, "code") else None
                error = getattr(code, "name", None) or type(err).__name__
                raise
            finally:
                telemetry.detach(token)
                telemetry.end_span(span, error=error)

        return grpc.unary_unary_rpc_method_handler(
            traced, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
