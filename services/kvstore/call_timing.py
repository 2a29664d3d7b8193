"""At --log-level debug, the kvstore's zero-copy calls log their size and wall time, and each
Commit the time of its check (the CRC-32C of every reserved slot's bytes; with --verify-on-commit
async, of recording the blocks only): where a save's time goes (bench/gpu_kv_tiers.py
--store-log-level debug). Nothing is timed at other levels."""
from __future__ import annotations

import functools
import logging
import time

log = logging.getLogger("meshllm.kvstore.server")


def timed_call(name: str):
    """A servicer method, its calls logged as `NAME blocks=N wall_ms=T`."""
    def wrap(fn):
        @functools.wraps(fn)
        async def call(self, request, context):
            if not log.isEnabledFor(logging.DEBUG):
                return await fn(self, request, context)
            t0 = time.perf_counter()
            try:
                return await fn(self, request, context)
            finally:
                n = len(request.checksums) if name == "commit" else len(request.block_hashes)
                log.debug("%s blocks=%d wall_ms=%.2f", name, n, (time.perf_counter() - t0) * 1e3)
        return call
    return wrap


def timed_commit(commit, *args):
    """commit(*args), its time logged as `commit check_ms=T`."""
    if not log.isEnabledFor(logging.DEBUG):
        return commit(*args)
    t0 = time.perf_counter()
    try:
        return commit(*args)
    finally:
        log.debug("commit check_ms=%.2f", (time.perf_counter() - t0) * 1e3)
