"""MicroBatcher: concurrent requests share forward passes, cancelled work never runs,
overload is refused, and a failed pass fails only its own requests.

The "model" here is a plain function of the token ids (vector = [first id, length]), so
each result can be checked against its input."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from services.embedder.batcher import MicroBatcher, QueueFull


class Model:
    """Records every batch it runs; `gate` lets a test hold a batch in the middle of its run."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()   # a batch reached the model

    def __call__(self, seqs):
        self.entered.set()
        self.gate.wait(5)
        self.batches.append([list(s) for s in seqs])
        if any(s[0] < 0 for s in seqs):
            raise RuntimeError("poisoned batch")
        return np.array([[s[0], len(s)] for s in seqs], dtype=np.float32)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def run(coro):
    return asyncio.run(coro)


async def until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.001)):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not met in time")


def test_requests_arriving_together_share_one_forward_pass(executor):
    model = Model()

    async def main():
        batcher = MicroBatcher(model, executor, max_batch_items=64, max_wait_s=0.05)
        batcher.start()
        results = await asyncio.gather(*(batcher.embed([[i, 7], [i + 100]]) for i in range(5)))
        await batcher.close()
        return results

    results = run(main())
    assert len(model.batches) == 1 and len(model.batches[0]) == 10
    for i, out in enumerate(results):
        assert out.tolist() == [[i, 2], [i + 100, 1]]


def test_a_request_larger_than_a_batch_is_split_and_reassembled_in_order(executor):
    model = Model()

    async def main():
        batcher = MicroBatcher(model, executor, max_batch_items=4, max_wait_s=0.0)
        batcher.start()
        out = await batcher.embed([[i] * (i + 1) for i in range(10)])
        await batcher.close()
        return out

    out = run(main())
    assert [len(b) for b in model.batches] == [4, 4, 2]
    assert out.tolist() == [[i, i + 1] for i in range(10)]


def test_items_arriving_while_a_batch_runs_form_the_next_batch(executor):
    model = Model()

    async def main():
        batcher = MicroBatcher(model, executor, max_batch_items=64, max_wait_s=0.0)
        batcher.start()
        model.gate.clear()
        first = asyncio.ensure_future(batcher.embed([[1]]))
        await until(model.entered.is_set)
        others = [asyncio.ensure_future(batcher.embed([[i]])) for i in (2, 3, 4)]
        await asyncio.sleep(0.02)
        model.gate.set()
        await asyncio.gather(first, *others)
        await batcher.close()

    run(main())
    assert model.batches == [[[1]], [[2], [3], [4]]]


def test_a_cancelled_request_never_reaches_the_model(executor):
    model = Model()

    async def main():
        batcher = MicroBatcher(model, executor, max_batch_items=64, max_wait_s=0.0)
        batcher.start()
        model.gate.clear()
        running = asyncio.ensure_future(batcher.embed([[1]]))
        await until(model.entered.is_set)
        doomed = asyncio.ensure_future(batcher.embed([[-5], [-6]]))
        kept = asyncio.ensure_future(batcher.embed([[7]]))
        await asyncio.sleep(0.01)
        doomed.cancel()
        await asyncio.sleep(0.01)
        assert batcher.num_queued == 1
        model.gate.set()
        await asyncio.gather(running, kept)
        await batcher.close()
        return kept.result()

    assert run(main()).tolist() == [[7, 1]]
    assert model.batches == [[[1]], [[7]]]


def test_more_queued_items_than_allowed_are_refused(executor):
    model = Model()

    async def main():
        batcher = MicroBatcher(model, executor, max_batch_items=2, max_wait_s=0.0,
                               max_queued_items=3)
        batcher.start()
        model.gate.clear()
        running = asyncio.ensure_future(batcher.embed([[1], [2]]))
        await until(model.entered.is_set)
        queued = asyncio.ensure_future(batcher.embed([[3], [4]]))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await batcher.embed([[5], [6]])
        model.gate.set()
        await asyncio.gather(running, queued)
        assert (await batcher.embed([[5], [6]])).tolist() == [[5, 1], [6, 1]]  # room again
        await batcher.close()

    run(main())


def test_a_failed_batch_fails_its_requests_and_the_next_batch_still_runs(executor):
    model = Model()

    async def main():
        batcher = MicroBatcher(model, executor, max_batch_items=64, max_wait_s=0.0)
        batcher.start()
        with pytest.raises(RuntimeError, match="poisoned"):
            await batcher.embed([[-1]])
        out = await batcher.embed([[8, 8]])
        await batcher.close()
        return out

    assert run(main()).tolist() == [[8, 2]]
