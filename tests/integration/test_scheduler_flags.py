"""Scheduler flags end to end: a mesh with async scheduling and prefix caching off and tiny
chunks answers exactly like the default mesh; the default mesh reports prefix-cache hits."""
from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest
from openai import OpenAI

from services.common import pb
from tests.integration.meshproc import start_mesh

PROMPTS = ["The three laws of motion are", "A recipe for pancakes:", "In the year 2100, cities will"]


def greedy_texts(mesh) -> list[str]:
    client = OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=300, max_retries=0)

    def one(p):
        return client.completions.create(model=mesh.model_name, prompt=p, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def plain_mesh(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--max-model-len", "512", "--no-async-scheduling",
                   "--no-enable-prefix-caching", "--max-num-batched-tokens", "16", "--scheduling-policy", "priority",
                   "--max-num-seqs", "1")
    yield m
    assert m.stop() == 0


def load(mesh) -> pb.engine.LoadInfo:
    with grpc.insecure_channel(mesh.services()["scheduler"]) as ch:
        return pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(), timeout=10)


def test_sync_unchunked_uncached_mesh_gives_the_same_greedy_text(mesh, plain_mesh):
    with cf.ThreadPoolExecutor(2) as pool:   # the two meshes at once
        plain, default = pool.map(greedy_texts, (plain_mesh, mesh))
    assert plain == default
    assert load(plain_mesh).prefix_cache_hits == 0


def test_a_repeated_long_prompt_hits_the_prefix_cache(mesh):
    client = OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=300, max_retries=0)
    prompt = "Here is a long document about gardening. " * 20
    before = load(mesh)
    texts = [client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=4, temperature=0)
             .choices[0].text for _ in range(2)]
    after = load(mesh)
    assert texts[0] == texts[1]
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 160 - 16
    assert after.prefix_cache_queries > before.prefix_cache_queries


def test_priority_policy_serves_the_more_urgent_waiting_request_first(plain_mesh):
    """One sequence at a time: while a long request runs, a priority -5 request that arrives
    after a priority 10 one still finishes first."""
    import threading
    import time
    client = OpenAI(base_url=f"{plain_mesh.http_url}/v1", api_key="unused", timeout=300, max_retries=0)
    done: dict[str, float] = {}

    def one(name, prio, tokens):
        client.completions.create(model=plain_mesh.model_name, prompt=f"{name}: tell me a story", max_tokens=tokens,
                                  temperature=0, extra_body={"ignore_eos": True, "priority": prio})
        done[name] = time.monotonic()

    blocker = threading.Thread(target=one, args=("blocker", 0, 40))
    blocker.start()
    deadline = time.monotonic() + 30
    while load(plain_mesh).num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    late = threading.Thread(target=one, args=("background", 10, 4))
    late.start()
    while load(plain_mesh).num_waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    urgent = threading.Thread(target=one, args=("urgent", -5, 4))
    urgent.start()
    for t in (blocker, late, urgent):
        t.join()
    assert done["urgent"] < done["background"]


def test_cache_salt_from_the_http_body_isolates_the_prefix_cache(mesh):
    client = OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=300, max_retries=0)
    prompt = "A long shared system prompt about tea ceremonies. " * 12

    def hits_after(salt):
        before = load(mesh).prefix_cache_hits
        client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": salt})
        return load(mesh).prefix_cache_hits - before

    hits_after("tenant-a")
    assert hits_after("tenant-b") == 0, "another tenant's salt must not hit tenant-a's blocks"
    assert hits_after("tenant-a") >= 16 * 5


def test_structured_outputs_validate_without_async_scheduling_and_with_16_token_chunks(plain_mesh):
    """The schema battery on the synchronous, one-sequence, 16-token-chunk mesh: every prompt is
    prefilled in several chunks before its first constrained token."""
    from openai import OpenAI

    from tests.integration import structured_battery as battery
    client = OpenAI(base_url=f"{plain_mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)
    # The whole battery (whole and streamed, n=2) runs on the async mesh. Here the sequences run
    # one at a time: greedy for nested and formats, n=2 (a sampled second choice waiting for the
    # one slot) for any_of and the streamed array. (n=2 goes to any_of, ~12 tokens a choice,
    # rather than to formats, whose uuid makes a choice ~60 tokens: one at a time, every token
    # counts.) Sent at once: they wait for the slot in the scheduler's queue (their grammars
    # compile meanwhile) instead of in this test.
    with cf.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(battery.run_whole, client, plain_mesh.model_name, name, n=n)
                for name, n in (("nested", 1), ("any_of", 2), ("formats", 1))]
        runs.append(pool.submit(battery.run_streamed, client, plain_mesh.model_name, "array"))
        assert [r.result() for r in runs] == [1, 2, 1, 2]
