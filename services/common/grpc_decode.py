"""Undecodable gRPC requests answered as what they are: INVALID_ARGUMENT with a plain message.

grpc's own handling of a request that fails to parse (bad protobuf, invalid UTF-8 in a string
field) is UNKNOWN with the Python exception class in the details. This interceptor gives every
handler a deserializer that turns a DecodeError into a marker, and a behaviour that answers the
marker with INVALID_ARGUMENT before any servicer code sees it (for streamed requests: at the
message that fails, ending the call)."""
from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    @property
    def message(self) -> str:
        return f"the request is not a valid {self.type_name} message (bad protobuf or invalid UTF-8)"


def _guard_deserializer(deserialize):
    if deserialize is None:
        return None
    type_name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request"

    def safe(data: bytes):
        try:
            return deserialize(data)
        except DecodeError:
            return _Undecodable(type_name)
    return safe


async def _checked(iterator, context):
    async for message in iterator:
        if isinstance(message, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.message)
        yield message


def _unary_in(behavior):
    async def wrapped(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)
    return wrapped


def _unary_in_stream_out(behavior):
    async def wrapped(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for response in behavior(request, context):
            yield response
    return wrapped


def _stream_in(behavior):
    async def wrapped(iterator, context):
        return await behavior(_checked(iterator, context), context)
    return wrapped


def _stream_in_stream_out(behavior):
    async def wrapped(iterator, context):
        async for response in behavior(_checked(iterator, context), context):
            yield response
    return wrapped


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """Installed innermost by make_server, so every servicer of every service is covered."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        kw = dict(request_deserializer=_guard_deserializer(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary_in(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_unary_in_stream_out(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_stream_in(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(_stream_in_stream_out(handler.stream_stream), **kw)
