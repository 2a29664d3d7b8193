"""Many concurrent SSE streams through a simulated-worker mesh (engine steps as fast as the
CPU allows, so the gateway falls behind and merges steps and deltas): every stream still
carries all its tokens, its finish reason and its usage, in well-formed chunks."""
import asyncio
import json

import httpx
import pytest

from tests.integration.meshproc import start_mesh

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def sim_mesh(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--max-num-seqs", "128",
                   "--max-model-len", "1024")
    yield m
    m.stop()


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> list:
    events = []
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _check(events: list, n: int, chat: bool) -> None:
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n * MAX_TOKENS
    finish = {}
    for c in body:
        assert c["usage"] is None and len(c["choices"]) == 1
        choice = c["choices"][0]
        assert choice["index"] not in finish, "a chunk after the choice's finish"
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    assert finish == {i: "length" for i in range(n)}
    # At most one chunk per token (plus the chat role chunk): deltas may merge, never split.
    per_choice = [sum(1 for c in body if c["choices"][0]["index"] == i) for i in range(n)]
    assert all(k <= MAX_TOKENS + (1 if chat else 0) for k in per_choice), per_choice


def test_concurrent_streams_under_load_carry_every_token_and_their_usage(sim_mesh):
    model = sim_mesh.model_name
    common = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    jobs = []
    for i in range(96):
        if i % 3 == 0:
            jobs.append(("/v1/chat/completions", {**common, "messages": [
                {"role": "user", "content": f"hello {i}"}]}, 1, True))
        else:
            jobs.append(("/v1/completions", {**common, "prompt": f"count to {i}",
                                             "n": 2 if i % 3 == 1 else 1}, 2 if i % 3 == 1 else 1,
                         False))

    async def run():
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=sim_mesh.http_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(_stream(c, path, body) for path, body, _, _ in jobs))

    results = asyncio.run(run())
    for (_, _, n, chat), events in zip(jobs, results):
        _check(events, n, chat)
