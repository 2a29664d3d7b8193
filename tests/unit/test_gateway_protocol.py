"""OpenAI request validation and conversion to the engine's SamplingParams; the ranges are the
rulebook's (tests/unit/test_sampling_rules.py), reached here as the HTTP API reaches them."""
import json

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from services.common.sampling_rules import Limits
from services.gateway.guard.sampling import check_request

LIMITS = Limits(max_model_len=100, vocab_size=1000)


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


def error_of(fn, *args) -> dict:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    assert exc.value.http_status == 400
    return exc.value.to_openai()["error"]


def http_checked(req) -> None:
    """What the HTTP routes do before tokenizing: convert, then the rules that need no prompt."""
    check_request(req.to_sampling(), req.rule_options(), LIMITS)


def test_completion_request_converts_to_sampling_params():
    req = parse_body(CompletionRequest, body(
        model="m", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3,
        stop="END", stop_token_ids=[5], ignore_eos=True, skip_special_tokens=False,
        metadata={"ignored": True}))  # an OpenAI field we accept and ignore
    sp = req.to_sampling()
    assert (sp.max_tokens, sp.top_k, sp.seed, list(sp.stop), list(sp.stop_token_ids)) == \
        (7, 40, 3, ["END"], [5])
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.ignore_eos and not sp.skip_special_tokens
    assert not sp.HasField("logprobs")


def test_unknown_fields_are_a_400_naming_the_field():
    err = error_of(parse_body, CompletionRequest, body(prompt="hi", unknown_field=1))
    assert err["param"] == "unknown_field" and "unknown_field" in err["message"]


def test_defaults_follow_openai_and_leave_max_tokens_to_the_context():
    sp = parse_body(CompletionRequest, body(prompt=[1, 2, 3])).to_sampling()
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.max_tokens == 0
    assert sp.skip_special_tokens and not sp.HasField("seed")


def test_prompt_may_be_token_ids_or_a_one_element_batch():
    assert parse_body(CompletionRequest, body(prompt=[[4, 5]])).prompt == [4, 5]
    assert parse_body(CompletionRequest, body(prompt=["x"])).prompt == "x"


@pytest.mark.parametrize("raw, needle, param", [
    (b"{not json", "not valid JSON", None),
    (b"[1, 2]", "must be a JSON object", None),
    (body(prompt=5), "prompt: must be a string, a list of token ids", "prompt"),
    (body(prompt=["a", [1]]), "a list of strings or a list of token-id lists", "prompt"),
    (body(prompt=["a"] * 65), "a batch holds at most 64 prompts", "prompt"),
    (body(), "prompt: Field required", "prompt"),
    (body(prompt="x", temperature="hot"), "temperature: Input should be a valid number",
     "temperature"),
    (body(prompt="x", max_tokens=True), "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (body(prompt="x", stop=[1]), "stop: must be a string or a list of strings", "stop"),
])
def test_malformed_bodies_give_readable_400s(raw, needle, param):
    err = error_of(parse_body, CompletionRequest, raw)
    assert needle in err["message"] and err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"logprobs": 21}, "logprobs"),
])
def test_unsupported_or_out_of_range_parameters_are_rejected(fields, param):
    req = parse_body(CompletionRequest, body(prompt="x", **fields))
    assert error_of(http_checked, req)["param"] == param


def test_n_and_logprobs_reach_the_engine_params():
    req = parse_body(CompletionRequest, body(prompt="x", n=3, logprobs=2))
    assert req.num_choices == 3 and req.to_sampling().logprobs == 2
    chat = parse_body(ChatCompletionRequest, body(messages=[{"role": "user", "content": "x"}],
                                                  logprobs=True, top_logprobs=4))
    assert chat.to_sampling().logprobs == 4
    plain = parse_body(ChatCompletionRequest, body(messages=[{"role": "user", "content": "x"}]))
    assert not plain.to_sampling().HasField("logprobs")


def test_chat_messages_with_text_parts_are_joined_and_max_completion_tokens_wins():
    req = parse_body(ChatCompletionRequest, body(
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}],
        max_tokens=50, max_completion_tokens=9, stream=True,
        stream_options={"include_usage": True}))
    msgs = req.to_chat_messages()
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "a\nb")]
    assert req.to_sampling().max_tokens == 9 and req.include_usage


def test_chat_rejects_image_parts_and_unknown_roles():
    req = parse_body(ChatCompletionRequest, body(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]))
    assert "only text parts" in error_of(req.to_chat_messages)["message"]
    err = error_of(parse_body, ChatCompletionRequest,
                   body(messages=[{"role": "robot", "content": "x"}]))
    assert err["param"] == "messages"


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 10 ** 12}, "max_tokens"), ({"top_k": 2 ** 40}, "top_k"),
    ({"stop_token_ids": [2 ** 31]}, "stop_token_ids"), ({"logit_bias": {str(2 ** 32): 1}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"), ({"priority": 2 ** 40}, "priority")])
def test_values_the_int32_wire_cannot_carry_are_a_400_naming_the_field(fields, param):
    req = parse_body(CompletionRequest, body(prompt="x", **fields))
    assert error_of(http_checked, req)["param"] == param


def test_explicit_zeros_are_out_of_range_but_absent_fields_take_the_default():
    for fields, param in (({"top_p": 0}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"max_completion_tokens": 0, "max_tokens": 5}, "max_tokens")):
        req = parse_body(ChatCompletionRequest, body(messages=[{"role": "user", "content": "x"}],
                                                     **fields))
        assert error_of(http_checked, req)["param"] == param
    http_checked(parse_body(CompletionRequest, body(prompt="x")))


def test_chat_top_logprobs_out_of_range_names_top_logprobs():
    req = parse_body(ChatCompletionRequest, body(messages=[{"role": "user", "content": "x"}],
                                                 logprobs=True, top_logprobs=21))
    err = error_of(http_checked, req)
    assert err["param"] == "top_logprobs" and err["message"] == "top_logprobs must be in [0, 20], got 21"


def test_integer_values_are_accepted_for_float_parameters():
    sp = parse_body(CompletionRequest, body(prompt="x", temperature=0, top_p=1)).to_sampling()
    assert sp.temperature == 0 and sp.top_p == 1
