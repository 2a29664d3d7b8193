"""Prompt logprobs end to end on the shared SmolLM2 mesh: vLLM's `prompt_logprobs` (completions
and chat, through the official openai client's extra_body), OpenAI's completions `echo` with
`logprobs` (whole and streamed), the public gRPC API, and the rule that such a request computes
its whole prompt (never a prefix-cache hit) while caching its blocks for the next one.

The cross-check needs no second model: the prompt's logprobs at position j are the model's
distribution after the first j tokens, which a one-token completion of exactly those tokens also
reports (its top_logprobs)."""
from __future__ import annotations

import math
import uuid

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from services.common import pb

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def client(mesh):
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


def tokenize(mesh, **body) -> list[int]:
    """vLLM's /tokenize: a prompt's ids, or (messages=...) the chat template's."""
    return httpx.post(f"{mesh.http_url}/tokenize", json={"model": mesh.model_name, **body}, timeout=60).json()["tokens"]


def detokenize(mesh, ids: list[int]) -> str:
    return httpx.post(f"{mesh.http_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


def check_vllm_shape(plp: list, prompt_ids: list[int], k: int) -> None:
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for position, entry in enumerate(plp[1:], start=1):
        own = str(prompt_ids[position])
        assert own in entry and max(k, 1) <= len(entry) <= k + 1
        ranks = sorted(v["rank"] for key, v in entry.items() if key != own or len(entry) == k)
        assert ranks[:k] == list(range(1, k + 1))   # the top k, ranked 1..k
        best = max(entry.values(), key=lambda v: v["logprob"])
        assert best["rank"] == 1 and all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
                                         for v in entry.values())
        assert (entry[own]["rank"] == 1) == (entry[own]["logprob"] >= best["logprob"] - 1e-6)


def test_completions_prompt_logprobs_are_the_models_distribution_after_each_prefix(client, mesh):
    ids = tokenize(mesh, prompt=PROMPT)
    r = client.completions.create(model=mesh.model_name, prompt=[PROMPT, "My name is"], max_tokens=2,
                                  temperature=0, extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].prompt_logprobs
    check_vllm_shape(plp, ids, 3)
    assert len(r.choices[1].prompt_logprobs) == len(tokenize(mesh, prompt="My name is"))
    assert "".join(plp[j][str(ids[j])]["decoded_token"] for j in range(1, len(ids))) == \
        PROMPT.removeprefix(detokenize(mesh, ids[:1]))
    # Position j's distribution, seen from a one-token completion of the first j tokens.
    for j in (1, len(ids) // 2, len(ids) - 1):
        one = client.completions.create(model=mesh.model_name, prompt=ids[:j], max_tokens=1,
                                        temperature=0, logprobs=3)
        top = one.choices[0].logprobs.top_logprobs[0]            # {token text: logprob}
        want = {v["decoded_token"]: v["logprob"] for v in plp[j].values() if v["rank"] <= 3}
        assert set(top) == set(want)
        for text, lp in top.items():
            assert lp == pytest.approx(want[text], abs=2e-3)
    plain = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=1)
    assert plain.choices[0].prompt_logprobs is None


def test_chat_prompt_logprobs_cover_the_templated_prompt(client, mesh):
    msgs = [{"role": "user", "content": "Name one color."}]
    r = client.chat.completions.create(model=mesh.model_name, messages=msgs, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    assert len(r.prompt_logprobs) == r.usage.prompt_tokens and r.prompt_logprobs[0] is None
    assert all(1 <= len(e) <= 2 for e in r.prompt_logprobs[1:])
    zero = client.chat.completions.create(model=mesh.model_name, messages=msgs, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    ids = tokenize(mesh, messages=msgs)
    assert [list(e) for e in zero.prompt_logprobs[1:]] == [[str(t)] for t in ids[1:]]   # only its own token
    plain = client.chat.completions.create(model=mesh.model_name, messages=msgs, max_tokens=1)
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("k", [0, 2])
def test_echo_with_logprobs_scores_the_prompt_first_whole_and_streamed(client, mesh, k):
    ids = tokenize(mesh, prompt=PROMPT)
    for prompt in (PROMPT, ids):
        r = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                      echo=True, logprobs=k)
        c = r.choices[0]
        lp = c.logprobs
        assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
        assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert all(max(k, 1) <= len(t) <= k + 1 for t in lp.top_logprobs[1:])
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        stream = list(client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=4,
                                                temperature=0, echo=True, logprobs=k, stream=True))
        chunks = [ch.choices[0] for ch in stream if ch.choices]
        assert "".join(ch.text for ch in chunks) == c.text
        assert chunks[0].text.startswith(PROMPT)
        streamed = [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens]
        assert streamed == lp.tokens
        s_lps = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
        assert s_lps[0] is None and s_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=2e-3)


def test_prompt_logprobs_requests_compute_the_whole_prompt_and_leave_it_cached(client, mesh):
    # A fresh prefix (no earlier test used it): 60+ tokens, several full KV blocks.
    text = f"Request {uuid.uuid4().hex}: " + "a list of fruits: apple, banana, cherry, grape, lemon, " * 4
    first = client.completions.create(model=mesh.model_name, prompt=text, max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
    again = client.completions.create(model=mesh.model_name, prompt=text, max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
    assert again.usage.prompt_tokens_details.cached_tokens == 0   # computed again, whole
    a, b = first.choices[0].prompt_logprobs, again.choices[0].prompt_logprobs
    assert len(a) == len(b) == first.usage.prompt_tokens
    for ea, eb in zip(a[1:], b[1:]):
        assert ea.keys() == eb.keys()
        for key in ea:
            assert ea[key]["logprob"] == pytest.approx(eb[key]["logprob"], abs=1e-3)
    plain = client.completions.create(model=mesh.model_name, prompt=text, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0     # the blocks it filled


def test_bad_prompt_logprobs_are_400s_naming_the_field(client, mesh):
    for extra, kw in (({"prompt_logprobs": 21}, {}), ({"prompt_logprobs": -1}, {}),
                      ({"prompt_logprobs": 2}, {"stream": True})):
        with pytest.raises(openai.BadRequestError) as exc:
            out = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=1,
                                            extra_body=extra, **kw)
            list(out)
        assert exc.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})


def test_grpc_generate_returns_prompt_logprobs_on_the_first_response(client, mesh):
    ids = tokenize(mesh, prompt=PROMPT)
    http = client.completions.create(model=mesh.model_name, prompt=ids, max_tokens=3, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).choices[0].prompt_logprobs
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        out = list(stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, token_ids=pb.common.TokenIds(ids=ids),
            sampling=pb.common.SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)), timeout=60))
        first = out[0].prompt_logprobs
        assert [lp.position for lp in first] == list(range(1, len(ids)))
        assert all(not r.prompt_logprobs for r in out[1:])
        for lp in first:
            assert lp.token_id == ids[lp.position] and lp.rank >= 1 and len(lp.top) == 2
            assert lp.logprob == pytest.approx(http[lp.position][str(lp.token_id)]["logprob"], abs=1e-3)
            assert math.isfinite(lp.logprob)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(pb.generation.GenerateRequest(
                model=mesh.model_name, text=PROMPT,
                sampling=pb.common.SamplingParams(max_tokens=1, prompt_logprobs=50)), timeout=60))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in exc.value.details()


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, mesh):
    """The scoring call of OpenAI's legacy API (and vLLM): the prompt back with its logprobs, no
    completion text."""
    ids = tokenize(mesh, prompt=PROMPT)
    full = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                                     echo=True, logprobs=1).choices[0].logprobs
    r = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.tokens == full.tokens[:len(ids)]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(full.token_logprobs[1:len(ids)], abs=1e-3)
    stream = [ch.choices[0] for ch in client.completions.create(
        model=mesh.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True) if ch.choices]
    assert "".join(ch.text for ch in stream) == PROMPT
    assert [t for ch in stream if ch.logprobs for t in ch.logprobs.tokens] == c.logprobs.tokens
    bare = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):   # without echo, max_tokens 0 stays a 400
        client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=0)
