"""Saving KV blocks to the kvstore off the caller's critical path (docs/kvstore.md): the engine
hands over blocks it no longer writes (host copies of full blocks of a finished prefill) and goes
on; one thread puts them. The queue is bounded in bytes: when the store is slower than the
engine, new saves are dropped (counted), never queued without bound and never waited for.

    saver = KvSaver(kv_client, max_pending_bytes=256 << 20)
    saver.submit(ns, [(block_hash, host_bytes), ...])   # False: dropped (queue full or closed)
    saver.close()                                        # stops after the queued saves, bounded"""
from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from services.common.kv_client import DROPPED, TIER, Block, KvClient


class KvSaver:
    def __init__(self, client: KvClient, max_pending_bytes: int = 256 << 20) -> None:
        if max_pending_bytes <= 0:
            raise ValueError("max_pending_bytes must be positive")
        self.client = client
        self.max_pending_bytes = max_pending_bytes
        self._queue: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self.saved = 0      # blocks the store holds after our puts
        self.dropped = 0    # blocks refused here (queue full, closed) or by the store
        self._thread = threading.Thread(target=self._run, name="kv-saver", daemon=True)
        self._thread.start()

    def submit(self, ns, blocks: Sequence[Block], before=None, after=None, put=None, nbytes: int | None = None) -> bool:
        """Queue blocks for saving; the caller must not change their buffers afterwards. False
        (and nothing queued) when they would push the queue past its bound. On the saver's
        thread `before()` runs before the put (e.g. wait for a device copy into the buffers) and
        `after(kept)` after it (e.g. give the buffers back; kept: blocks the store holds, 0 when
        the put failed), whatever the put's outcome. `put(ns, blocks) -> kept` replaces the
        client's put (e.g. a device-to-store copy, services/worker/kv_store_io.py); with it,
        `nbytes` is what the blocks hold (their buffers need not be bytes-like then)."""
        if nbytes is None:
            nbytes = sum(memoryview(buf).nbytes for _, buf in blocks)
        with self._cond:
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped += len(blocks)
                DROPPED.labels(TIER).inc(len(blocks))
                return False
            self._queue.append((ns, list(blocks), nbytes, before, after, put))
            self._pending_bytes += nbytes
            self._cond.notify()
        return True

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                ns, blocks, nbytes, before, after, put = self._queue.popleft()
            kept = 0
            try:
                if before is not None:
                    before()
                kept = (put or self.client.put)(ns, blocks)   # never raises; counts its own drops
            except Exception:  # noqa: BLE001 - a failed copy is a dropped save
                kept = 0
            finally:
                if after is not None:
                    after(kept)
            with self._cond:
                self._pending_bytes -= nbytes
                self.saved += kept
                self.dropped += len(blocks) - kept
                self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save was attempted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._pending_bytes, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """No new saves; the queued ones get `timeout_s` (each put has its own deadline too)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
