"""The event loop a service runs on: uvloop when it is installed, else asyncio's own.

uvloop (libuv) runs callbacks and socket writes several times cheaper than asyncio's
selector loop, which matters where one loop streams hundreds of SSE responses (the
gateway). grpc.aio and pyzmq's asyncio sockets work on it unchanged.
MESHLLM_EVENT_LOOP=asyncio forces the standard loop (to compare, or to rule uvloop out)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None (asyncio's default) when absent or turned off."""
    if os.environ.get("MESHLLM_EVENT_LOOP", "auto") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop chosen by loop_factory()."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
