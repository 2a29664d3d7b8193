"""The pure parts of vLLM's extra fields: prompt truncation, the /invocations dispatch, batch
prompts, stream_options without stream, chat echo and the answer's role."""
import json

import pytest

from services.gateway.clients.request_handle import Delta
from services.gateway.errors import ApiError
from services.gateway.http.invocations import route_of
from services.gateway.openai.choices import ChoiceBuilder, ChoiceSpec
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.gateway.openai.truncation import truncate_prompt


def param_of(fn, *args) -> str:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    assert exc.value.http_status == 400
    return exc.value.to_openai()["error"]["param"]


def test_truncation_keeps_the_last_tokens_by_default_or_the_first_on_the_right():
    ids = list(range(10))
    assert truncate_prompt(ids, 3, None, 100) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "left", 100) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "right", 100) == [0, 1, 2]
    assert truncate_prompt(ids, None, None, 100) == ids
    assert truncate_prompt(ids, 50, None, 100) == ids
    assert truncate_prompt(ids, -1, None, 4) == [6, 7, 8, 9]   # -1: the context length
    for bad in (0, -2, 101):
        assert param_of(truncate_prompt, ids, bad, None, 100) == "truncate_prompt_tokens"
    assert param_of(truncate_prompt, ids, 3, "middle", 100) == "truncation_side"


@pytest.mark.parametrize("body, key", [
    ({"messages": [], "prompt": "x"}, "messages"), ({"prompt": "x"}, "prompt"), ({"input": "x"}, "input")])
def test_invocations_dispatch_on_the_first_key_in_vllms_order(body, key):
    assert route_of(json.dumps(body).encode()) == key


@pytest.mark.parametrize("raw", [b'{"text": "x"}', b"[1]", b"{nope", b"[" * 100 + b"]" * 100])
def test_invocations_refuse_a_body_of_no_known_shape(raw):
    with pytest.raises(ApiError) as exc:
        route_of(raw)
    assert exc.value.http_status == 400


def test_batches_of_strings_or_token_lists_are_one_request():
    req = parse_body(CompletionRequest, json.dumps({"prompt": ["a", "b"], "n": 2}).encode())
    assert req.prompts == ["a", "b"]
    req.to_sampling()
    ids = parse_body(CompletionRequest, json.dumps({"prompt": [[1, 2], [3]]}).encode())
    assert ids.prompts == [[1, 2], [3]]
    assert parse_body(CompletionRequest, b'{"prompt": [1, 2]}').prompts == [[1, 2]]
    big = parse_body(CompletionRequest, json.dumps({"prompt": ["a"] * 20, "n": 16}).encode())
    assert param_of(big.to_sampling) == "n"    # 320 choices > 256


def test_stream_options_need_stream():
    req = parse_body(CompletionRequest, b'{"prompt": "x", "stream_options": {"include_usage": true}}')
    assert param_of(req.to_sampling) == "stream_options"
    ok = parse_body(CompletionRequest, b'{"prompt": "x", "stream": true, "stream_options": '
                                       b'{"include_usage": true, "continuous_usage_stats": true}}')
    ok.to_sampling()
    assert ok.include_usage and ok.continuous_usage
    nulls = b'{"include_usage": null, "continuous_usage_stats": null}'
    streamed = parse_body(CompletionRequest, b'{"prompt": "x", "stream": true, "stream_options": ' + nulls + b'}')
    streamed.to_sampling()
    assert not streamed.include_usage and not streamed.continuous_usage
    unstreamed = parse_body(CompletionRequest, b'{"prompt": "x", "stream_options": ' + nulls + b'}')
    assert param_of(unstreamed.to_sampling) == "stream_options"   # as vLLM: any options need a stream
    parse_body(CompletionRequest, b'{"prompt": "x", "stream_options": {}}').to_sampling()   # vLLM lets {} pass


def test_chat_echo_follows_the_answers_role():
    def chat(**kw):
        return parse_body(ChatCompletionRequest, json.dumps(kw).encode())
    user, asst = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    assert chat(messages=[user, asst], echo=True).echo_text() == "A"
    assert chat(messages=[user], echo=True).echo_text() == ""
    continued = chat(messages=[user], echo=True, add_generation_prompt=False)
    assert continued.response_role == "user" and continued.echo_text() == "Q"
    assert chat(messages=[user, asst]).echo_text() == ""


def _stream(builder, deltas):
    out = [choice for choice, _ in builder.opening()]
    for d in deltas:
        out += builder.stream(d)
    return out


def test_completion_chunks_carry_prompt_ids_once_and_every_token_id():
    spec = ChoiceSpec(chat=False, logprobs=False, return_token_ids=True)
    deltas = [Delta("", [7]), Delta(" hi", [8]), Delta("!", [9], finish_reason="length")]
    chunks = _stream(ChoiceBuilder(3, spec, echo="P", prompt_ids=[1, 2]), deltas)
    assert chunks[0] == {"index": 3, "text": "P", "logprobs": None, "finish_reason": None,
                         "prompt_token_ids": [1, 2], "token_ids": []}
    assert [c["token_ids"] for c in chunks[1:]] == [[7], [8], [9]]   # a text-less delta still tells its ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    whole = ChoiceBuilder(3, spec, echo="P", prompt_ids=[1, 2])
    for d in [Delta("", [7]), Delta(" hi", [8]), Delta("!", [9], finish_reason="length")]:
        whole.add(d)
    assert whole.whole()["text"] == "P hi!" and whole.whole()["token_ids"] == [7, 8, 9]


def test_chat_echo_is_streamed_after_the_role_and_prefixes_the_whole_content():
    spec = ChoiceSpec(chat=True, logprobs=False, echo="The sky is", role="assistant",
                      return_token_ids=True)
    builder = ChoiceBuilder(0, spec, prompt_ids=[5])
    (role, top), (echo, _) = builder.opening()
    assert role["delta"] == {"role": "assistant", "content": ""} and top == {"prompt_token_ids": [5]}
    assert echo["delta"] == {"content": "The sky is"}
    whole = ChoiceBuilder(0, spec, prompt_ids=[5])
    whole.add(Delta(" blue", [11], finish_reason="stop"))
    out = whole.whole()
    assert out["message"]["content"] == "The sky is blue" and out["token_ids"] == [11]
