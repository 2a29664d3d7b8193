"""The mesh through the official `openai` client: completions and chat, streaming and not."""
from __future__ import annotations

import concurrent.futures

import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(mesh):
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_lists_the_served_model(client, mesh):
    ids = [m.id for m in client.models.list().data]
    assert ids == [mesh.model_name, "all-minilm-l6-v2"]  # the shared mesh also serves embeddings


def test_completion_returns_text_usage_and_finish_reason(client, mesh):
    r = client.completions.create(model=mesh.model_name, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("cmpl-")


def test_max_tokens_bounds_the_output_with_finish_reason_length(client, mesh):
    r = client.completions.create(model=mesh.model_name, prompt="Count: one, two, three,", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_completion_answers_as_assistant(client, mesh):
    r = client.chat.completions.create(model=mesh.model_name, max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "What is 2+2?"}])
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.id.startswith("chatcmpl-") and r.usage.completion_tokens <= 16


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streamed_deltas_concatenate_to_the_non_streamed_text(client, mesh, kind):
    args = dict(model=mesh.model_name, max_tokens=40, temperature=0)
    if kind == "completions":
        create, args["prompt"] = client.completions.create, "Once upon a time, in a small village,"
    else:
        create, args["messages"] = client.chat.completions.create, [
            {"role": "user", "content": "Write two sentences about autumn."}]
    # Both at once: the engine batches them (greedy batched == solo: test_greedy_parity.py).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(create, **args)
        chunks = list(create(stream=True, stream_options={"include_usage": True}, **args))
        full = whole.result(timeout=120)
    if kind == "completions":
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    else:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    assert text == expected and text
    assert len([c for c in chunks if c.choices]) > 3, "a stream should arrive in several chunks"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == full.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


def test_stop_string_ends_the_output_and_is_not_included(client, mesh):
    base = client.completions.create(model=mesh.model_name, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # Take a stop string from the middle of the greedy output (it may span token boundaries).
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip(), f"greedy output too short to pick a stop string from: {base!r}"
    # The whole and the streamed stopped answer at once (batched greedy == solo).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.completions.create, model=mesh.model_name, prompt="1, 2, 3, 4,", max_tokens=20,
                            temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        streamed = pool.submit(lambda: "".join(c.choices[0].text for c in client.completions.create(
            model=mesh.model_name, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop], stream=True,
            extra_body={"ignore_eos": True}) if c.choices))
        r, streamed = whole.result(), streamed.result()
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert streamed == r.choices[0].text


def test_seeded_sampling_is_reproducible(client, mesh):
    args = dict(model=mesh.model_name, prompt="My favourite colour is", max_tokens=12, temperature=1.0,
                top_p=0.95)
    a = client.completions.create(seed=1234, **args).choices[0].text
    # The repeat comes after the first (a later request, not its batch mate); the other seeds
    # beside it (a seed is per request: its draws do not depend on the batch).
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda s: client.completions.create(seed=s, **args).choices[0].text, (1234, 1, 2, 3)))
    b, others = texts[0], set(texts[1:])
    assert a == b
    assert len(others | {a}) > 1, "different seeds should not all give the same text"
