"""The worker's pipelined engine loop (--overlap-steps on: submit step N+1, then reply to step N)
over real ZMQ with the scheduler's async scheduling, on the CPU where it is off by default: the
same greedy and seeded texts as the default mesh, concurrent streams included, and a clean stop."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
from openai import OpenAI

from tests.integration.meshproc import start_mesh

PROMPTS = ["The three laws of motion are", "A recipe for pancakes:", "In the year 2100, cities will",
           "Dear diary, today"]


def texts(mesh, seeded: bool = True) -> list[str]:
    client = OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=300, max_retries=0)

    def one(i_p):
        i, p = i_p
        extra = {"ignore_eos": True}
        if seeded and i % 2:  # seeded sampling: the draw depends on the position of the pending token
            return client.completions.create(model=mesh.model_name, prompt=p, max_tokens=12, temperature=0.8,
                                             seed=42 + i, extra_body=extra).choices[0].text
        return client.completions.create(model=mesh.model_name, prompt=p, max_tokens=12, temperature=0,
                                         extra_body=extra).choices[0].text
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, enumerate(PROMPTS)))


@pytest.fixture(scope="module")
def overlap_mesh(smollm2_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHLLM_OVERLAP_STEPS", "on")   # inherited by the worker the supervisor starts
        m = start_mesh(str(smollm2_dir), "--max-model-len", "512")
    yield m
    assert m.stop() == 0


def test_overlapped_worker_gives_the_default_meshs_texts(mesh, overlap_mesh):
    # Each round asks the two meshes at once: separate engines, each sees only its own batch.
    with cf.ThreadPoolExecutor(2) as pool:
        got, want = pool.map(texts, (overlap_mesh, mesh))
        assert got == want
        # all greedy: every step samples straight into the prev-token buffer the next step overwrites
        got, want = pool.map(lambda m: texts(m, seeded=False), (overlap_mesh, mesh))
        assert got == want
