"""Every OpenAI sampling / output parameter through the official client, checked by its
effect (each assertion would fail if the parameter were ignored)."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from services.common import pb

PROMPT = "The quick brown fox"
REPEAT = "I like apples. I like apples. I like"


@pytest.fixture(scope="module")
def client(mesh):
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
        yield c


def complete(client, mesh, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 8)
    extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                                    "stop_token_ids") if k in kw}
    return client.completions.create(model=mesh.model_name, prompt=prompt, extra_body=extra or None, **kw)


def greedy_ids(mesh, prompt, max_tokens=8):
    """Greedy token ids (gRPC gives ids; the OpenAI shapes give text)."""
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        out = list(pb.generation_grpc.GenerationStub(ch).Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text=prompt,
            sampling=pb.common.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), timeout=60))
    return [t for r in out for t in r.token_ids]


@pytest.fixture(scope="module")
def greedy(client, mesh):
    return complete(client, mesh, temperature=0, ignore_eos=True).choices[0].text


def test_logit_bias_plus_100_makes_that_token_the_output(client, mesh, http):
    tid = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    r = complete(client, mesh, temperature=0, max_tokens=3, logit_bias={str(tid): 100}, ignore_eos=True)
    assert r.choices[0].text == " banana" * 3


@pytest.mark.parametrize("param", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_penalties_change_the_greedy_output(client, mesh, param):
    base = complete(client, mesh, REPEAT, temperature=0, max_tokens=10, ignore_eos=True).choices[0].text
    assert base.count("apple") >= 2, base  # the unpenalised model repeats itself
    value = 1.8 if param == "repetition_penalty" else 2.0
    pen = complete(client, mesh, REPEAT, temperature=0, max_tokens=10, ignore_eos=True, **{param: value})
    assert pen.choices[0].text != base


def test_min_tokens_and_ignore_eos_force_the_length_past_eos(client, mesh, http):
    eos = http.post("/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1
    args = dict(model=mesh.model_name, messages=[{"role": "user", "content": "Say yes."}], temperature=0,
                max_completion_tokens=8, logit_bias={str(eos[0]): 100})
    base = client.chat.completions.create(**args)  # EOS is the only thing it can say
    assert base.usage.completion_tokens == 1 and base.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**args, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    ign = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    assert ign.usage.completion_tokens == 8 and ign.choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_output_with_that_token(client, mesh):
    ids = greedy_ids(mesh, PROMPT)
    stop = ids[3]
    r = complete(client, mesh, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    assert r.usage.completion_tokens == ids.index(stop) + 1
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    # vLLM's rule: the stopping token is not text, unless include_stop_str_in_output.
    upto = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=ids.index(stop),
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    assert r.choices[0].text == upto
    kept = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                 "include_stop_str_in_output": True}).choices[0].text
    assert kept.startswith(upto) and len(kept) > len(upto)


def test_the_eos_token_is_never_text_even_with_special_tokens_kept(client, mesh):
    r = client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=64, temperature=0, extra_body={"skip_special_tokens": False})
    assert r.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in r.choices[0].message.content and r.choices[0].message.content


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"top_p": 0.001}, {"min_p": 1.0}])
def test_restrictive_top_k_top_p_min_p_at_temperature_1_equal_greedy(client, mesh, greedy, extra):
    r = complete(client, mesh, temperature=1.0, seed=3, ignore_eos=True, **extra)
    assert r.choices[0].text == greedy


def test_temperature_and_seed(client, mesh, greedy):
    hot = [complete(client, mesh, temperature=1.5, seed=s, ignore_eos=True).choices[0].text for s in (1, 1, 2)]
    assert hot[0] == hot[1], "same seed, same text"
    assert hot[0] != hot[2], "different seed, different text"
    assert greedy not in hot


def test_n_gives_independent_indexed_choices_with_usage_summed(client, mesh):
    r = complete(client, mesh, n=3, temperature=1.0, seed=11, logprobs=0, ignore_eos=True, max_tokens=6)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices) == 18
    again = complete(client, mesh, n=3, temperature=1.0, seed=11, logprobs=0, ignore_eos=True, max_tokens=6)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chunks = list(client.chat.completions.create(
        model=mesh.model_name, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5,
        temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 10


def test_completion_logprobs_are_consistent_with_the_text(client, mesh, greedy):
    r = complete(client, mesh, temperature=0, logprobs=3, ignore_eos=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == 8
    assert "".join(lp.tokens) == r.choices[0].text == greedy
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    streamed = complete(client, mesh, temperature=0, logprobs=3, ignore_eos=True, stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs_and_top_logprobs(client, mesh):
    args = dict(model=mesh.model_name, messages=[{"role": "user", "content": "Name a color."}],
                max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**args)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    stream = list(client.chat.completions.create(stream=True, **args))
    streamed = [t.token for c in stream if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]
    plain = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_echo_prefixes_the_prompt(client, mesh, greedy):
    # echo with logprobs (the prompt's logprobs first): tests/integration/test_prompt_logprobs.py
    r = complete(client, mesh, temperature=0, echo=True, ignore_eos=True)
    assert r.choices[0].text == PROMPT + greedy
    streamed = "".join(c.choices[0].text for c in complete(client, mesh, temperature=0, echo=True,
                                                           ignore_eos=True, stream=True) if c.choices)
    assert streamed == PROMPT + greedy


def test_usage_counts_equal_the_tokenizer_counts_and_user_is_accepted(client, mesh, http):
    msgs = [{"role": "user", "content": "What is the capital of Italy?"}]
    r = client.chat.completions.create(model=mesh.model_name, messages=msgs, max_tokens=3, user="alice")
    assert r.usage.prompt_tokens == http.post("/tokenize", json={"messages": msgs}).json()["count"]
    c = complete(client, mesh, max_tokens=2, user="bob")
    assert c.usage.prompt_tokens == http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]


def test_tokenize_and_detokenize_round_trip_in_vllm_shapes(http, mesh):
    tok = http.post("/tokenize", json={"model": mesh.model_name, "prompt": "Hello there, world!",
                                       "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
    assert tok["token_strs"][:3] == ["Hello", "Ġthere", ","]   # the vocabulary's strings (vLLM)
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello there, world!"}
    bad = http.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={}).status_code == 400


STREAMED_KW = [
    {"temperature": 0, "presence_penalty": 2.0},
    {"temperature": 0, "frequency_penalty": 2.0},
    {"temperature": 0, "repetition_penalty": 1.8},
    {"temperature": 1.0, "seed": 7, "top_p": 0.9},
    {"temperature": 1.0, "seed": 7, "top_k": 5, "min_p": 0.05},
    {"temperature": 0, "min_tokens": 6, "ignore_eos": True},
    {"temperature": 0, "stop": [" apples"]},
    {"temperature": 0, "max_tokens": 3},
]


def _whole_and_streamed(client, mesh, kw: dict) -> tuple:
    kw = dict(kw)
    kw.setdefault("max_tokens", 10)
    whole = complete(client, mesh, REPEAT, **dict(kw))
    extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens") if k in kw}
    chunks = list(client.completions.create(model=mesh.model_name, prompt=REPEAT, stream=True,
                                            extra_body=extra or None, **kw))
    return whole, chunks


@pytest.fixture(scope="module")
def whole_and_streamed(client, mesh):
    """Every case of the test below asked at once (the engine batches them; one or two at a time
    cost nearly as much each): one future per case, of (whole, streamed chunks)."""
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(len(STREAMED_KW)) as pool:
        yield [pool.submit(_whole_and_streamed, client, mesh, kw) for kw in STREAMED_KW]


@pytest.mark.parametrize("case", range(len(STREAMED_KW)), ids=[f"kw{i}" for i in range(len(STREAMED_KW))])
def test_streaming_gives_the_same_effect_as_non_streaming(whole_and_streamed, case):
    """The same parameters streamed and not give the same text and finish reason."""
    whole, chunks = whole_and_streamed[case].result(timeout=240)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].text
    assert finish == [whole.choices[0].finish_reason]
