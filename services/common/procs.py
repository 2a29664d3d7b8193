"""Process helpers: children die with their launcher, services stop on SIGTERM."""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux).

    Used as subprocess `preexec_fn` so a SIGKILLed launcher leaves no service behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:  # not Linux: watch_parent() still covers it
        pass


def watch_parent(on_orphaned, interval_s: float = 1.0) -> None:
    """Call `on_orphaned()` once if the process that started us goes away.

    A fallback for MESHLLM_PARENT_PID when PDEATHSIG is unavailable."""
    parent = os.environ.get("MESHLLM_PARENT_PID")
    if not parent:
        return
    parent_pid = int(parent)

    def _loop() -> None:
        import time
        while True:
            time.sleep(interval_s)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                on_orphaned()
                return
            except PermissionError:
                continue

    threading.Thread(target=_loop, name="parent-watch", daemon=True).start()


def install_stop_handlers(loop: asyncio.AbstractEventLoop, stop: asyncio.Event,
                          hard_exit_after_s: float = 15.0) -> None:
    """SIGTERM / SIGINT set `stop` so a service can shut down gracefully.

    A graceful stop that hangs (a stuck stream, a busy thread) must never leave the process
    behind: a second signal, or `hard_exit_after_s` after the first, ends it at once."""
    state = {"signalled": False}

    def on_stop() -> None:
        if state["signalled"]:
            os._exit(1)
        state["signalled"] = True
        timer = threading.Timer(hard_exit_after_s, os._exit, (1,))
        timer.daemon = True
        timer.start()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    watch_parent(lambda: loop.call_soon_threadsafe(on_stop))


def boot_id() -> str:
    """This machine's boot id ("" where /proc does not have it): two processes with the same one
    run on the same host (kernel), so shared memory between them can work."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""
