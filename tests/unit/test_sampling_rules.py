"""The sampling rulebook (services/common/sampling_rules.py): the rules themselves, the same
error for the same bad sampling whether it came over HTTP or gRPC, and the worker's subset."""
import json

import pytest

from services.common import pb
from services.common.sampling_rules import (Limits, RequestOptions, SamplingRuleError,
                                            check_engine_sampling, check_request, fit_to_prompt)
from services.gateway.errors import ApiError
from services.gateway.guard import sampling as gateway_rules
from services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body

LIMITS = Limits(max_model_len=100, vocab_size=1000)


def error_of(fn, *args) -> SamplingRuleError:
    with pytest.raises(SamplingRuleError) as exc:
        fn(*args)
    return exc.value


# ---- prompt-dependent rules (after tokenization) ---------------------------------------------

def test_prompt_plus_max_tokens_beyond_context_is_rejected():
    sp = pb.common.SamplingParams(max_tokens=30)
    err = error_of(fit_to_prompt, sp, [1] * 80, LIMITS)
    assert "maximum context length is 100" in err.message and err.param == "max_tokens"


def test_missing_max_tokens_fills_the_rest_of_the_context():
    sp = pb.common.SamplingParams()
    assert fit_to_prompt(sp, [1] * 80, LIMITS).max_tokens == 20
    assert sp.max_tokens == 0  # the caller's message is left as it was


def test_min_tokens_may_not_exceed_the_resolved_max_tokens():
    err = error_of(fit_to_prompt, pb.common.SamplingParams(max_tokens=2, min_tokens=5), [1], LIMITS)
    assert err.param == "min_tokens" and err.message == "min_tokens (5) must not exceed max_tokens (2)"
    # max_tokens 0 resolves to the room left (10), so min_tokens 10 fits and 11 does not.
    fit_to_prompt(pb.common.SamplingParams(min_tokens=10), [1] * 90, LIMITS)
    assert error_of(fit_to_prompt, pb.common.SamplingParams(min_tokens=11), [1] * 90,
                    LIMITS).param == "min_tokens"


@pytest.mark.parametrize("prompt, needle", [
    ([], "empty"), ([1] * 100, "maximum context length"), ([1, 1000], "outside the vocabulary")])
def test_bad_prompts_are_rejected(prompt, needle):
    assert needle in error_of(fit_to_prompt, pb.common.SamplingParams(), prompt, LIMITS).message


def test_a_chat_prompt_error_names_messages():
    assert error_of(fit_to_prompt, pb.common.SamplingParams(), [], LIMITS, "messages").param == "messages"


# ---- rules that need no prompt (before tokenization) -----------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"), ({"stop": [""]}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 99}, "logprobs"),
    ({"temperature": float("nan")}, "temperature")])
def test_sampling_ranges_are_checked(fields, param):
    sp = pb.common.SamplingParams(**fields)
    assert error_of(check_request, sp, RequestOptions(), LIMITS).param == param


def test_too_many_stop_strings_are_rejected():
    sp = pb.common.SamplingParams(stop=[f"s{i}" for i in range(33)])
    assert "at most 32" in error_of(check_request, sp, RequestOptions(), LIMITS).message


@pytest.mark.parametrize("options, param", [
    (RequestOptions(n=0), "n"), (RequestOptions(n=17), "n"),
    (RequestOptions(cache_salt="a" * 257), "cache_salt"), (RequestOptions(cache_salt="a b"), "cache_salt"),
    (RequestOptions(priority=2 ** 31), "priority")])
def test_request_fields_besides_the_sampling_params_are_checked(options, param):
    assert error_of(check_request, pb.common.SamplingParams(), options, LIMITS).param == param


def test_wire_zeros_mean_default_unless_the_client_gave_an_explicit_zero():
    sp = pb.common.SamplingParams()  # top_p 0, repetition_penalty 0, max_tokens 0: defaults
    check_request(sp, RequestOptions(), LIMITS)
    for name in ("top_p", "repetition_penalty", "max_tokens"):
        err = error_of(check_request, sp, RequestOptions(explicit_zeros=frozenset({name})), LIMITS)
        assert err.param == name


def test_a_request_breaking_several_rules_gets_the_first_in_the_rulebook_order():
    sp = pb.common.SamplingParams(temperature=-1, stop_token_ids=list(range(65)))
    assert error_of(check_request, sp, RequestOptions(n=17), LIMITS).param == "n"
    assert error_of(check_request, sp, RequestOptions(), LIMITS).param == "stop_token_ids"


# ---- HTTP and gRPC meet the same rules -------------------------------------------------------

PARITY = [  # (id, OpenAI completion fields, the same request as SamplingParams fields, options)
    ("temperature", {"temperature": -1}, {"temperature": -1}, {}),
    ("top_p", {"top_p": 1.5}, {"top_p": 1.5}, {}),
    ("top_k", {"top_k": -2}, {"top_k": -2}, {}),
    ("min_p", {"min_p": 2}, {"min_p": 2}, {}),
    ("presence_penalty", {"presence_penalty": 3}, {"presence_penalty": 3}, {}),
    ("repetition_penalty", {"repetition_penalty": -1}, {"repetition_penalty": -1}, {}),
    ("logprobs", {"logprobs": 21}, {"logprobs": 21}, {}),
    ("logit_bias_id", {"logit_bias": {"5000": 1}}, {"logit_bias": {5000: 1}}, {}),
    ("logit_bias_value", {"logit_bias": {"5": 200}}, {"logit_bias": {5: 200}}, {}),
    ("stop_token_ids", {"stop_token_ids": [5000]}, {"stop_token_ids": [5000]}, {}),
    ("stop_empty", {"stop": [""]}, {"stop": [""]}, {}),
    ("stop_count", {"stop": ["x"] * 33}, {"stop": ["x"] * 33}, {}),
    ("n", {"n": 17}, {}, {"n": 17}),
    ("cache_salt", {"cache_salt": "a b"}, {}, {"cache_salt": "a b"}),
    ("max_tokens", {"max_tokens": -1}, {"max_tokens": -1}, {}),
    ("min_tokens", {"min_tokens": -1}, {"min_tokens": -1}, {}),
    ("max_tokens_over_context", {"max_tokens": 98}, {"max_tokens": 98}, {}),
    ("min_tokens_over_max", {"max_tokens": 2, "min_tokens": 5}, {"max_tokens": 2, "min_tokens": 5}, {}),
]
PROMPT = [1, 2, 3]


def _api_error(fn) -> tuple[str, str | None]:
    with pytest.raises(ApiError) as exc:
        fn()
    assert exc.value.http_status == 400 and exc.value.grpc_status.name == "INVALID_ARGUMENT"
    return exc.value.message, exc.value.param


def _over_http(fields: dict) -> None:
    """As the HTTP routes: parse, convert, the rules before tokenizing, then those after."""
    req = parse_body(CompletionRequest, json.dumps({"prompt": PROMPT, **fields}).encode())
    sp = req.to_sampling()
    gateway_rules.check_request(sp, req.rule_options(), LIMITS)
    gateway_rules.fit_to_prompt(sp, req.prompt, LIMITS)


def _over_grpc(fields: dict, options: dict) -> None:
    """As GenerationServicer.Generate and Gateway.start_n: the message as the client sent it."""
    sp = pb.common.SamplingParams(**fields)
    gateway_rules.check_request(sp, RequestOptions(**options), LIMITS)
    gateway_rules.fit_to_prompt(sp, PROMPT, LIMITS)


@pytest.mark.parametrize("openai_fields, proto_fields, options", [c[1:] for c in PARITY],
                         ids=[c[0] for c in PARITY])
def test_http_and_grpc_give_the_same_error_for_the_same_bad_sampling(openai_fields, proto_fields,
                                                                      options):
    over_http = _api_error(lambda: _over_http(openai_fields))
    assert over_http == _api_error(lambda: _over_grpc(proto_fields, options))
    assert over_http[1] is not None


def test_a_good_request_passes_both_ways_with_max_tokens_resolved_alike():
    req = parse_body(ChatCompletionRequest, json.dumps({
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3,
        "temperature": 0.5, "stop": "END"}).encode())
    sp = req.to_sampling()
    gateway_rules.check_request(sp, req.rule_options(), LIMITS)
    http_sp = gateway_rules.fit_to_prompt(sp, PROMPT, LIMITS)
    grpc_sp = gateway_rules.fit_to_prompt(pb.common.SamplingParams(
        temperature=0.5, top_p=1.0, logprobs=3, stop=["END"], skip_special_tokens=True), PROMPT, LIMITS)
    assert http_sp == grpc_sp and http_sp.max_tokens == 97


# ---- the worker's subset ---------------------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"temperature": float("nan")}, "temperature"), ({"presence_penalty": float("inf")}, "presence_penalty"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": 1.01}, "top_p"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"), ({"logit_bias": {1000: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logprobs": -1}, "logprobs")])
def test_the_engine_subset_refuses_what_would_misbehave_on_the_device(fields, param):
    err = error_of(check_engine_sampling, pb.common.SamplingParams(**fields), 1000)
    assert err.param == param and isinstance(err, ValueError)


def test_the_engine_subset_keeps_wire_defaults_and_leaves_gateway_limits_to_the_gateway():
    check_engine_sampling(pb.common.SamplingParams(), 1000)  # every zero means "default"
    # Gateway-only bounds: the worker clamps logprobs and ignores stop strings.
    check_engine_sampling(pb.common.SamplingParams(logprobs=50, stop=[""] * 100, top_k=-7), 1000)


def test_the_engine_subset_uses_the_gateways_messages():
    sp = pb.common.SamplingParams(top_p=1.5)
    assert (error_of(check_engine_sampling, sp, 1000).message
            == error_of(check_request, sp, RequestOptions(), LIMITS).message)
