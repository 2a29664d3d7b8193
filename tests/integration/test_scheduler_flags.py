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
                   "--no-enable-prefix-caching", "--max-num-batched-tokens", "16", "--scheduling-policy", "priority")
    yield m
    assert m.stop() == 0


def load(mesh) -> pb.engine.LoadInfo:
    with grpc.insecure_channel(mesh.services()["scheduler"]) as ch:
        return pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(), timeout=10)


def test_sync_unchunked_uncached_mesh_gives_the_same_greedy_text(mesh, plain_mesh):
    assert greedy_texts(plain_mesh) == greedy_texts(mesh)
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
