"""A server-streaming handler behind make_server's interceptors is cleaned up as soon as the
client cancels: its `finally` (where the gateway aborts the engine request) must not wait for
the garbage collector to break a reference cycle."""
import asyncio
import gc

import grpc

from services.common.grpc_server import bind, make_server


def test_cancelled_stream_runs_the_handlers_cleanup_at_once_without_the_gc():
    async def scenario() -> float:
        cleaned = asyncio.Event()
        payload = b"x" * (256 * 1024)

        async def endless(request, context):
            try:
                while True:
                    # Large messages fill the flow-control window of a client that stops
                    # reading, so the cancel lands while grpc is sending, outside this
                    # generator (which grpc then abandons at its yield).
                    yield payload
            finally:
                cleaned.set()

        server, _ = make_server("streamtest", [])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Stream", {
            "Endless": grpc.unary_stream_rpc_method_handler(endless)}),))
        port = bind(server, "127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_stream("/test.Stream/Endless")(b"")
                assert await call.read() == payload
                await asyncio.sleep(0.3)  # the server blocks on the full window
                t0 = asyncio.get_running_loop().time()
                call.cancel()
                await asyncio.wait_for(cleaned.wait(), timeout=5)
                return asyncio.get_running_loop().time() - t0
        finally:
            await server.stop(0)

    gc.disable()  # cycles are never collected here: cleanup must not depend on them
    try:
        for _ in range(5):
            assert asyncio.run(scenario()) < 1.0
    finally:
        gc.enable()
