"""Drive a backend with a list of requests: Poisson (or gamma) arrivals at a request rate, an
optional cap on concurrency, warm-ups, and a progress bar. Returns results and the duration."""
from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.benchmark.datasets import SampleRequest
from services.benchmark.metrics import RequestResult


@dataclass
class LoadShape:
    request_rate: float = math.inf   # requests/s; inf sends every request at once
    burstiness: float = 1.0          # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None


def arrival_delays(n: int, shape: LoadShape, seed: int) -> list[float]:
    """Send times (s after the start) of n requests: gamma inter-arrivals with mean 1/rate."""
    if math.isinf(shape.request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (shape.request_rate * shape.burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape.burstiness, theta)
    return out


class Progress:
    """A small progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.done = self.failed = 0
        self.tty = sys.stderr.isatty()
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self._draw(now, "\r")
        elif (d := 10 * self.done // self.total) != self._last_decile:
            self._last_decile = d
            self._draw(now, "")

    def _draw(self, now: float, lead: str) -> None:
        frac = self.done / self.total
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        el = now - self._t0
        eta = el / frac - el if frac else 0.0
        fail = f", {self.failed} failed" if self.failed else ""
        end = "\n" if not self.tty or self.done == self.total else ""
        sys.stderr.write(f"{lead}{self.label} |{bar}| {self.done}/{self.total} "
                         f"[{el:5.1f}s<{eta:5.1f}s, {self.done / el if el else 0:.1f} req/s{fail}]{end}")
        sys.stderr.flush()


async def run_load(send: Callable[[SampleRequest], "asyncio.Future[RequestResult]"],
                   requests: list[SampleRequest], shape: LoadShape, seed: int,
                   progress: Progress | None = None) -> tuple[list[RequestResult], float]:
    delays = arrival_delays(len(requests), shape, seed)
    sem = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    results: list[RequestResult | None] = [None] * len(requests)
    t0 = time.perf_counter()

    async def one(i: int, req: SampleRequest) -> None:
        wait = t0 + delays[i] - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if sem is None:
            sent = time.perf_counter() - t0
            r = await send(req)
        else:
            async with sem:
                sent = time.perf_counter() - t0
                r = await send(req)
        r.start = sent
        results[i] = r
        if progress:
            progress.update(r.success)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return [r for r in results if r is not None], time.perf_counter() - t0


async def warm_up(send, requests: list[SampleRequest], concurrency: int | None) -> list[RequestResult]:
    """Run `requests` before measuring (excluded from the results), `concurrency` at a time."""
    if not requests:
        return []
    sem = asyncio.Semaphore(concurrency or len(requests))

    async def one(req):
        async with sem:
            return await send(req)
    return list(await asyncio.gather(*(one(r) for r in requests)))
