"""Greedy output of the mesh equals transformers' greedy output on the same converted weights."""
from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest
import torch
from openai import OpenAI

from services.common import pb

PROMPTS = [
    "The quick brown fox",
    "In 1492, Christopher Columbus",
    "def fibonacci(n):\n",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tok, model


_HF_GREEDY: dict[tuple, list[int]] = {}


def hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with transformers, not stopping at EOS (each prompt computed once:
    two tests ask for the same one)."""
    key = (tuple(prompt_ids), n)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = _hf_greedy(hf, prompt_ids, n)
    return list(_HF_GREEDY[key])


def _hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    _, model = hf
    ids: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            nxt = int(out.logits[0, -1].argmax())
            ids.append(nxt)
            out = model(torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
    return ids


def mesh_generate_ids(stub, model, prompt_ids, n, ignore_eos=True) -> list[int]:
    req = pb.generation.GenerateRequest(model=model, token_ids=pb.common.TokenIds(ids=prompt_ids),
                                        sampling=pb.common.SamplingParams(max_tokens=n, ignore_eos=ignore_eos))
    ids = []
    for resp in stub.Generate(req, timeout=300):
        ids.extend(resp.token_ids)
    return ids


@pytest.fixture(scope="module")
def stub(mesh):
    ch = grpc.insecure_channel(mesh.grpc_addr)
    yield pb.generation_grpc.GenerationStub(ch)
    ch.close()


def test_greedy_tokens_equal_transformers(hf, stub, mesh):
    tok, _ = hf
    prompt_ids = [tok(prompt)["input_ids"] for prompt in PROMPTS]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:   # the mesh's requests at once (batched == solo: below)
        mesh_ids = [pool.submit(mesh_generate_ids, stub, mesh.model_name, ids, NEW_TOKENS) for ids in prompt_ids]
        for i, (ids, got) in enumerate(zip(prompt_ids, mesh_ids)):
            expected = hf_greedy(hf, ids, NEW_TOKENS)
            got = got.result()
            assert got == expected, f"prompt {i} diverged at token " \
                                    f"{next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)}"


def test_greedy_text_through_openai_equals_transformers(hf, mesh):
    tok, _ = hf
    client = OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=300, max_retries=0)
    prompt = PROMPTS[0]
    expected = tok.decode(hf_greedy(hf, tok(prompt)["input_ids"], NEW_TOKENS), skip_special_tokens=True)
    r = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected


def test_concurrent_requests_equal_their_solo_outputs(stub, mesh, hf):
    # Six prompts of 1 to 16 words batched together (the worker-level test batches 16).
    tok, _ = hf
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    prompts = [tok(" ".join(words[: 1 + 3 * i]) + " and then")["input_ids"] for i in range(6)]
    solo = [mesh_generate_ids(stub, mesh.model_name, p, 16) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: mesh_generate_ids(stub, mesh.model_name, p, 16), prompts))
    assert all(len(s) == 16 for s in solo)
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a == b, f"request {i} differs when batched"
