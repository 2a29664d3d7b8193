"""vLLM's and OpenAI's completions / chat fields beyond sampling, through the official client
(extra_body where it has no field), httpx and the gRPC stubs, checked by their effect: batched
prompts, return_token_ids, prompt truncation, continuous usage, chat echo, cached_tokens,
stream_options without stream, /tokenize's token strings, /tokenizer_info, /invocations, and
the API staying open with only an admin key."""
from __future__ import annotations

import json
import uuid

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from services.common import pb
from tests.integration.gateway_proc import start_gateway

PROMPTS = ["The capital of France is", "One, two, three,"]
GREEDY = dict(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def client(mesh):
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
        yield c


def tokens_of(http, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def text_of(http, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def sse_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- /tokenize ----------------------------------------------------------------------------------

def test_tokenize_token_strs_are_the_vocabulary_strings_even_past_1024_tokens(http, mesh, smollm2_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    out = http.post("/tokenize", json={"prompt": "What is 😀 here?", "return_token_strs": True}).json()
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    assert "Ġis" in out["token_strs"] and not any("\ufffd" in t for t in out["token_strs"])
    long = http.post("/tokenize", json={"prompt": "apple pie " * 700, "return_token_strs": True})
    assert long.status_code == 200, long.text
    body = long.json()
    assert body["count"] > 1024 and len(body["token_strs"]) == body["count"]
    assert http.post("/tokenize", json={"prompt": "hi"}).json()["token_strs"] is None
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        tok = pb.generation_grpc.GenerationStub(ch).Tokenize(pb.generation.TokenizeRequest(
            model=mesh.model_name, text="What is 😀 here?", return_token_strs=True), timeout=30)
    assert list(tok.token_strs) == out["token_strs"]


# -- stream_options -----------------------------------------------------------------------------

def test_stream_options_without_stream_is_a_400(client, mesh):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=mesh.model_name, prompt="hi", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=mesh.model_name, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       stream=False, stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"


# -- batched prompts ----------------------------------------------------------------------------

def test_a_batch_of_prompts_gives_prompt_major_choices_with_summed_usage(client, http, mesh):
    singles = [client.completions.create(model=mesh.model_name, prompt=p, **GREEDY) for p in PROMPTS]
    batch = client.completions.create(model=mesh.model_name, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert texts == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(2 * s.usage.completion_tokens for s in singles)
    # token-id prompts, streamed, with the final usage
    ids = [tokens_of(http, prompt=p) for p in PROMPTS]
    streamed: dict[int, str] = {}
    final = None
    for chunk in client.completions.create(model=mesh.model_name, prompt=ids, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
        final = chunk.usage or final
    assert streamed == {0: singles[0].choices[0].text, 1: singles[1].choices[0].text}
    assert final.prompt_tokens == sum(map(len, ids))


def test_a_batch_echoes_each_prompt_and_a_bad_prompt_fails_the_whole_request(client, http, mesh):
    out = client.completions.create(model=mesh.model_name, prompt=PROMPTS, echo=True, **GREEDY)
    for prompt, choice in zip(PROMPTS, out.choices):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    ids = tokens_of(http, prompt=PROMPTS[0])
    echoed = client.completions.create(model=mesh.model_name, prompt=[ids], echo=True, **GREEDY)
    assert echoed.choices[0].text.startswith(PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=mesh.model_name, prompt=[ids, [10 ** 8]], **GREEDY)
    assert err.value.body["param"] == "prompt"


# -- return_token_ids ---------------------------------------------------------------------------

def test_return_token_ids_in_completions_whole_and_streamed(http, mesh):
    body = {"model": mesh.model_name, "prompt": PROMPTS[0], "return_token_ids": True, **GREEDY}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["prompt_token_ids"] == tokens_of(http, prompt=PROMPTS[0])
    assert len(whole["token_ids"]) == 5 and text_of(http, whole["token_ids"]) == whole["text"]
    chunks = [c["choices"][0] for c in sse_chunks(http, "/v1/completions", body) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]


def test_return_token_ids_in_chat_whole_and_streamed(http, mesh):
    messages = [{"role": "user", "content": "Say hi"}]
    body = {"model": mesh.model_name, "messages": messages, "return_token_ids": True, **GREEDY}
    whole = http.post("/v1/chat/completions", json=body).json()
    assert whole["prompt_token_ids"] == tokens_of(http, messages=messages)
    choice = whole["choices"][0]
    assert text_of(http, choice["token_ids"]) == choice["message"]["content"]
    chunks = sse_chunks(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]


def test_token_ids_end_with_the_eos_token_and_logprob_tokens_can_be_ids(client, http, mesh, smollm2_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    out = http.post("/v1/chat/completions", json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": "Say only: hi"}],
        "temperature": 0, "max_tokens": 40, "return_token_ids": True}).json()
    choice = out["choices"][0]
    if choice["finish_reason"] == "stop":   # as vLLM: the ids include the end token, the text not
        assert hf.decode(choice["token_ids"]) == choice["message"]["content"] + "<|im_end|>"
    lp = client.completions.create(model=mesh.model_name, prompt=PROMPTS[0], logprobs=2,
                                   extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
                                   **GREEDY).choices[0]
    ids = lp.model_extra["token_ids"]
    assert lp.logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert all(k.startswith("token_id:") for top in lp.logprobs.top_logprobs for k in top)


# -- truncation ---------------------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(client, http, mesh):
    prompt = "Once upon a time there was a small village by the sea where"
    full = tokens_of(http, prompt=prompt)
    for side, kept in (("left", full[-4:]), ("right", full[:4]), (None, full[-4:])):
        extra = {"truncate_prompt_tokens": 4, "return_token_ids": True}
        if side:
            extra["truncation_side"] = side
        out = client.completions.create(model=mesh.model_name, prompt=prompt, extra_body=extra, **GREEDY)
        assert out.usage.prompt_tokens == 4
        assert out.choices[0].model_extra["prompt_token_ids"] == kept
        same = client.completions.create(model=mesh.model_name, prompt=kept, **GREEDY)
        assert out.choices[0].text == same.choices[0].text
    chat = client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": prompt}],
                                          extra_body={"truncate_prompt_tokens": 6}, **GREEDY)
    assert chat.usage.prompt_tokens == 6
    for bad in (0, -2, 10 ** 6):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=mesh.model_name, prompt=prompt,
                                      extra_body={"truncate_prompt_tokens": bad}, **GREEDY)
        assert err.value.body["param"] == "truncate_prompt_tokens"


def test_grpc_generate_truncates_and_returns_prompt_token_ids(http, mesh):
    prompt = "Once upon a time there was a small village by the sea where"
    full = tokens_of(http, prompt=prompt)
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        out = list(stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text=prompt, truncate_prompt_tokens=4, truncation_side="right",
            return_prompt_token_ids=True, n=2,
            sampling=pb.common.SamplingParams(max_tokens=3)), timeout=60))
        firsts = {}
        for r in out:
            firsts.setdefault(r.index, list(r.prompt_token_ids))
        assert firsts == {0: full[:4], 1: full[:4]}
        assert sum(len(r.prompt_token_ids) > 0 for r in out) == 2
        assert out[-1].usage.prompt_tokens == 4
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.generation.GenerateRequest(
                model=mesh.model_name, text=prompt, truncate_prompt_tokens=0,
                sampling=pb.common.SamplingParams(max_tokens=3)), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- usage --------------------------------------------------------------------------------------

def test_continuous_usage_stats_put_usage_on_every_chunk(client, mesh):
    chunks = list(client.chat.completions.create(
        model=mesh.model_name, messages=[{"role": "user", "content": "Count to five"}], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    plain = list(client.chat.completions.create(
        model=mesh.model_name, messages=[{"role": "user", "content": "Count to five"}], stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 5


def test_cached_tokens_are_always_in_the_usage(client, mesh):
    prompt = f"{uuid.uuid4()} " + "a long shared preamble about apples and pears, " * 6
    first = client.completions.create(model=mesh.model_name, prompt=prompt, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=mesh.model_name, prompt=prompt, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    streamed = list(client.completions.create(
        model=mesh.model_name, prompt=f"{uuid.uuid4()} pears", stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 0
    again = list(client.completions.create(
        model=mesh.model_name, prompt=prompt, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert again[-1].usage.prompt_tokens_details.cached_tokens > 0


# -- chat echo ----------------------------------------------------------------------------------

def test_chat_echo_prefixes_the_continued_assistant_turn(client, mesh):
    messages = [{"role": "user", "content": "Describe the sky."},
                {"role": "assistant", "content": "The sky is"}]
    kw = dict(model=mesh.model_name, messages=messages, **GREEDY)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(extra_body=cont, **kw).choices[0].message
    echoed = client.chat.completions.create(extra_body={**cont, "echo": True}, **kw).choices[0].message
    assert echoed.role == "assistant" and echoed.content == "The sky is" + plain.content
    chunks = list(client.chat.completions.create(extra_body={**cont, "echo": True}, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "The sky is"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.content
    # After a generation prompt the answer is a new assistant turn: a user message is not echoed.
    user_only = [{"role": "user", "content": "Describe the sky."}]
    a = client.chat.completions.create(model=mesh.model_name, messages=user_only, **GREEDY)
    b = client.chat.completions.create(model=mesh.model_name, messages=user_only,
                                       extra_body={"echo": True}, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content


# -- /tokenizer_info and /invocations -----------------------------------------------------------

ADMIN = "admin-only-key-1234"


@pytest.fixture(scope="module")
def flagged_gw(mesh):
    """A second gateway: an admin key alone, and /tokenizer_info turned on."""
    gw = start_gateway(mesh, "--admin-api-key", ADMIN, "--enable-tokenizer-info-endpoint")
    yield gw
    gw.stop()


def test_tokenizer_info_is_off_by_default_and_shows_the_tokenizer_config_when_on(http, flagged_gw, smollm2_dir):
    off = http.get("/tokenizer_info")
    assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]
    info = httpx.get(f"http://127.0.0.1:{flagged_gw.http_port}/tokenizer_info", timeout=30).json()
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == config["chat_template"]
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == config["model_max_length"]


def test_invocations_route_by_body_shape(http, mesh):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], **GREEDY})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    cmpl = http.post("/invocations", json={"prompt": PROMPTS[0], **GREEDY})
    assert cmpl.status_code == 200 and cmpl.json()["object"] == "text_completion"
    emb = http.post("/invocations", json={"input": "hello"})
    assert emb.status_code == 200 and emb.json()["data"][0]["object"] == "embedding"
    for bad in ({"text": "hi"}, [1, 2], {"prompt": "hi", "temperature": "hot"}):
        r = http.post("/invocations", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    streamed = sse_chunks(http, "/invocations", {"prompt": PROMPTS[0], **GREEDY})
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == cmpl.json()["choices"][0]["text"]


# -- auth: admin keys alone leave the API open ----------------------------------------------------

def test_an_admin_key_alone_guards_admin_routes_but_leaves_the_api_open(flagged_gw):
    admin, gw = ADMIN, flagged_gw
    url = f"http://127.0.0.1:{gw.http_port}"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
    as_admin = {"Authorization": f"Bearer {admin}"}
    assert httpx.get(f"{url}/v1/models", headers=as_admin, timeout=30).status_code == 200
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 401
    with grpc.insecure_channel(gw.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        assert stub.ListModels(pb.generation.ListModelsRequest(), timeout=30).models


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
def test_the_sdks_model_dump_has_the_raw_responses_keys(client, http, mesh, path):
    """vLLM's /invocations test compares an SDK object's model_dump() with the raw JSON: every
    field the SDK declares is in the body (null where unset), nothing the SDK fills in is missing."""
    body = {"model": mesh.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0}
    sdk = client.chat.completions.create(**body).model_dump()
    raw = http.post(path, json=body).json()
    assert sdk.keys() == raw.keys()
    assert sdk["choices"][0]["message"].keys() == raw["choices"][0]["message"].keys()
    assert sdk["choices"][0]["message"]["content"] == raw["choices"][0]["message"]["content"]
    comp = client.completions.create(model=mesh.model_name, prompt="Hi", max_tokens=4, temperature=0).model_dump()
    raw = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "Hi", "max_tokens": 4,
                                             "temperature": 0}).json()
    assert comp.keys() == raw.keys()
