"""Micro-batching: items of Embed calls that arrive together share one forward pass.

One loop owns the model. When it is idle and work arrives, it waits up to `max_wait_s`
for more (or until `max_batch_items` are queued), then runs everything queued up to that
size in a worker thread. Items that arrive while a batch runs form the next batch, so a
busy embedder batches continuously without waiting at all.
A request's items may be split over several batches; its future resolves when all are
done. A cancelled request's queued items are dropped before they reach the model.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("meshllm.embedder.batcher")


class QueueFull(Exception):
    """More items are waiting than the embedder accepts (answer RESOURCE_EXHAUSTED)."""


@dataclass(eq=False)
class _Job:
    seqs: Sequence[Sequence[int]]
    future: asyncio.Future
    out: np.ndarray | None = None            # [len(seqs), dims], filled as batches finish
    remaining: int = 0
    pending: deque = field(default_factory=deque)   # indices not yet handed to a batch


class MicroBatcher:
    def __init__(self, run_batch: Callable[[list[Sequence[int]]], np.ndarray],
                 executor: Executor, *, max_batch_items: int = 64, max_wait_s: float = 0.005,
                 max_queued_items: int = 65536) -> None:
        self._run_batch = run_batch
        self._executor = executor
        self.max_batch_items, self.max_wait_s = max_batch_items, max_wait_s
        self.max_queued_items = max_queued_items
        self._jobs: deque[_Job] = deque()    # jobs with items not yet in a batch, FIFO
        self.num_queued = 0                  # items in self._jobs
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches_run = 0                 # for logs and tests
        self.last_batch_size = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="embed-batcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in self._jobs:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the embedder is shutting down"))
        self._jobs.clear()

    async def embed(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """Vectors [len(seqs), dims] of these token-id lists (each already validated)."""
        if self.num_queued + len(seqs) > self.max_queued_items:
            raise QueueFull(f"the embedder has {self.num_queued} items queued; "
                            f"at most {self.max_queued_items} may wait")
        job = _Job(seqs, asyncio.get_running_loop().create_future(), remaining=len(seqs),
                   pending=deque(range(len(seqs))))
        self._jobs.append(job)
        self.num_queued += len(seqs)
        self._wakeup.set()
        try:
            return await job.future
        finally:
            if job.pending:   # cancelled while queued: its items never reach the model
                self.num_queued -= len(job.pending)
                job.pending.clear()

    def _take(self) -> list[tuple[_Job, int]]:
        """Up to max_batch_items queued (job, index) pairs, oldest job first."""
        taken: list[tuple[_Job, int]] = []
        while self._jobs and len(taken) < self.max_batch_items:
            job = self._jobs[0]
            if job.future.done():      # cancelled: embed()'s finally already uncounted it
                self._jobs.popleft()
                continue
            while job.pending and len(taken) < self.max_batch_items:
                taken.append((job, job.pending.popleft()))
                self.num_queued -= 1
            if not job.pending:
                self._jobs.popleft()
        return taken

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._jobs:
                self._wakeup.clear()
                await self._wakeup.wait()
                # Idle until now: give requests that arrive together a moment to join.
                deadline = loop.time() + self.max_wait_s
                while self.num_queued < self.max_batch_items and loop.time() < deadline:
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), deadline - loop.time())
                    except TimeoutError:
                        break
            taken = self._take()
            if not taken:
                continue
            started = time.perf_counter()
            try:
                vectors = await loop.run_in_executor(
                    self._executor, self._run_batch, [job.seqs[i] for job, i in taken])
            except Exception as exc:   # one failed batch fails its requests, not the embedder
                log.exception("embedding batch of %d items failed", len(taken))
                for job in {job for job, _ in taken}:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            self.batches_run += 1
            self.last_batch_size = len(taken)
            log.debug("batch items=%d jobs=%d ms=%.1f", len(taken), len({j for j, _ in taken}),
                      (time.perf_counter() - started) * 1e3)
            for row, (job, i) in enumerate(taken):
                if job.future.done():
                    continue
                if job.out is None:
                    job.out = np.empty((len(job.seqs), vectors.shape[1]), dtype=np.float32)
                job.out[i] = vectors[row]
                job.remaining -= 1
                if job.remaining == 0:
                    job.future.set_result(job.out)
