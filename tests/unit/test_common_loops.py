"""The services' event loop: uvloop when installed, asyncio's own when asked or absent."""
import asyncio
import importlib.util

import pytest

from services.common import loops


async def _loop_type():
    return type(asyncio.get_running_loop()).__module__


def test_meshllm_event_loop_asyncio_forces_the_standard_loop(monkeypatch):
    monkeypatch.setenv("MESHLLM_EVENT_LOOP", "asyncio")
    assert loops.loop_factory() is None
    assert loops.run(_loop_type()).startswith("asyncio")


def test_auto_uses_uvloop_exactly_when_it_is_installed(monkeypatch):
    monkeypatch.delenv("MESHLLM_EVENT_LOOP", raising=False)
    installed = importlib.util.find_spec("uvloop") is not None
    assert (loops.loop_factory() is not None) == installed
    assert loops.run(_loop_type()).startswith("uvloop" if installed else "asyncio")


def test_grpc_aio_runs_on_the_chosen_loop():
    import grpc

    async def call():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/x.Y/Z")(b"", timeout=5)
        await server.stop(None)
        return err.value.code()

    assert loops.run(call()) == grpc.StatusCode.UNIMPLEMENTED
