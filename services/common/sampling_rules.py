"""The sampling rulebook: every rule a request's sampling must meet, written once, for the
gateway's HTTP and gRPC APIs alike and for the worker's guard on its ZMQ link.

Pure: values in, a value or a SamplingRuleError (message + the request field it names) out;
no I/O, no torch, no protobuf import (a pb.common.SamplingParams is read by its fields). Zero
means "default" on the wire (common.proto), and the rules read it that way.

In the order a request meets them:
- `check_request`, before tokenization: every rule that needs no prompt (ranges, n, logprobs,
  logit_bias, stop strings and stop token ids, ignore_eos vs a structured output, cache_salt,
  priority), so no tokenizer work is spent on a request that will be refused. The output
  constraint itself is checked by services/common/structured.check (which imports this
  module), called right after by the gateway.
- `fit_to_prompt`, after tokenization: the prompt's ids against the vocabulary and the
  context, max_tokens resolved (0 = up to the context; prompt + max_tokens must fit) and
  min_tokens <= max_tokens. Its result is what the engine is sent (EngineSubmit's contract:
  max_tokens >= 1); nothing after it checks the sampling again.
- `check_engine_sampling`: the subset the worker needs against bad bytes on its link.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 16                 # choices per request (each is its own engine request)
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 1024      # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 64
# cache_salt goes into the prefix-cache hash; printable, no spaces, so logs stay one line.
_CACHE_SALT = re.compile(r"^[A-Za-z0-9._:@/+=\-]*$")
# Every float field must be finite: a NaN passes every range comparison below.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")


class SamplingRuleError(ValueError):
    """A broken rule: `message` is for the client, `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Limits:
    """The engine's bounds (context, vocabulary) and the deployment's (stop strings)."""

    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 32
    max_stop_string_chars: int = 512
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS


@dataclass(frozen=True)
class RequestOptions:
    """The fields of a request besides its SamplingParams that the rules cover."""

    n: int = 1
    cache_salt: str = ""
    priority: int = 0
    # Fields the client set to an explicit 0 where the wire's 0 means "default": OpenAI's
    # max_tokens=0, top_p=0 or repetition_penalty=0 is out of range, not a request for the default.
    explicit_zeros: frozenset[str] = frozenset()
    # The field the client named the top-logprobs count with (chat: top_logprobs).
    logprobs_param: str = "logprobs"


def check_request(sp: Any, options: RequestOptions, limits: Limits) -> None:
    """The rules that need no prompt, in a fixed order (a request breaking several gets the
    first): raises SamplingRuleError, else returns and the request may be tokenized."""
    if not 1 <= options.n <= MAX_N:
        raise SamplingRuleError(f"n must be in [1, {MAX_N}], got {options.n}", "n")
    if len(sp.logit_bias) > limits.max_logit_bias:
        raise SamplingRuleError(f"logit_bias may have at most {limits.max_logit_bias} entries, "
                                f"got {len(sp.logit_bias)}", "logit_bias")
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise SamplingRuleError(f"at most {limits.max_stop_token_ids} stop_token_ids are "
                                f"allowed, got {len(sp.stop_token_ids)}", "stop_token_ids")
    _logprobs(sp, MAX_LOGPROBS, options.logprobs_param)
    _prompt_logprobs(sp, MAX_LOGPROBS)
    zeros = options.explicit_zeros
    if sp.max_tokens < 0 or (sp.max_tokens == 0 and "max_tokens" in zeros):
        raise SamplingRuleError(f"max_tokens must be at least 1, got {sp.max_tokens}",
                                "max_tokens")
    if sp.top_k < -1:
        raise SamplingRuleError(f"top_k must be -1 (disabled) or at least 1, got {sp.top_k}",
                                "top_k")
    if sp.min_tokens < 0:
        raise SamplingRuleError(f"min_tokens must be >= 0, got {sp.min_tokens}", "min_tokens")
    _finite(sp)
    _temperature(sp)
    _top_p(sp, zero_given="top_p" in zeros)
    _min_p(sp)
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sp, name) <= 2:
            raise SamplingRuleError(f"{name} must be in [-2, 2], got {getattr(sp, name)}", name)
    _repetition_penalty(sp, zero_given="repetition_penalty" in zeros)
    for tid in sp.stop_token_ids:
        if not 0 <= tid < limits.vocab_size:
            raise SamplingRuleError(f"stop_token_ids contains {tid}, outside the vocabulary "
                                    f"[0, {limits.vocab_size})", "stop_token_ids")
    _logit_bias_ids(sp, limits.vocab_size)
    for bias in sp.logit_bias.values():
        if not -100 <= bias <= 100:
            raise SamplingRuleError(f"logit_bias values must be in [-100, 100], got {bias}",
                                    "logit_bias")
    _stop_strings(sp.stop, limits)
    if sp.ignore_eos and sp.HasField("structured"):
        # The grammar decides where the output ends (it allows EOS only once complete).
        raise SamplingRuleError("ignore_eos cannot be combined with structured outputs", "ignore_eos")
    check_cache_salt(options.cache_salt)
    check_int32("priority", options.priority)


def fit_to_prompt(sp: Any, prompt_ids: Sequence[int], limits: Limits,
                  prompt_param: str = "prompt") -> Any:
    """The rules that need the prompt; returns a copy of `sp` with max_tokens resolved
    (0 = the rest of the context), which is what the engine is sent. `sp` has passed
    check_request."""
    check_prompt(prompt_ids, limits, prompt_param)
    fitted = type(sp)()
    fitted.CopyFrom(sp)
    prompt_len = len(prompt_ids)
    if fitted.max_tokens == 0:
        fitted.max_tokens = limits.max_model_len - prompt_len  # >= 1: check_prompt left room
    elif prompt_len + fitted.max_tokens > limits.max_model_len:
        raise SamplingRuleError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {prompt_len + fitted.max_tokens} tokens ({prompt_len} in the prompt, "
            f"{fitted.max_tokens} in the completion). Please reduce the length of the prompt or "
            f"of the completion.", "max_tokens")
    if fitted.min_tokens > fitted.max_tokens:
        raise SamplingRuleError(f"min_tokens ({fitted.min_tokens}) must not exceed max_tokens "
                                f"({fitted.max_tokens})", "min_tokens")
    return fitted


def check_prompt(prompt_ids: Sequence[int], limits: Limits, param: str = "prompt") -> None:
    """A prompt of token ids: not empty, in the vocabulary, leaving room for one token."""
    if not prompt_ids:
        raise SamplingRuleError("the prompt is empty: it must contain at least one token", param)
    check_token_ids(prompt_ids, limits.vocab_size, param)
    if len(prompt_ids) >= limits.max_model_len:
        raise SamplingRuleError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your prompt has {len(prompt_ids)} tokens, which leaves no room for a completion. "
            f"Please reduce the length of the prompt.", param)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for tid in token_ids:
        if not 0 <= tid < vocab_size:
            raise SamplingRuleError(f"token id {tid} is outside the vocabulary [0, {vocab_size})",
                                    param)


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise SamplingRuleError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
                                f"got {len(salt)}", "cache_salt")
    if not _CACHE_SALT.match(salt):
        raise SamplingRuleError("cache_salt may only contain [A-Za-z0-9._:@/+=-]", "cache_salt")


def check_int32(param: str, value: int) -> None:
    """Integer fields travel as int32: a bigger value cannot even be put on the wire."""
    if not -(2 ** 31) <= value < 2 ** 31:
        raise SamplingRuleError(f"{param} must fit in a signed 32-bit integer, got {value}", param)


def check_engine_sampling(sp: Any, vocab_size: int) -> None:
    """The worker's guard on its ZMQ link: the rules without which sampling would misbehave
    on the device (finite floats, temperature >= 0, top_p and min_p in [0, 1],
    repetition_penalty >= 0, logit_bias ids inside the vocabulary, logprobs >= 0).

    The gateway already enforced these (and more) through check_request; a worker calls this
    on every new request's SamplingParams from a StepPlan, so bytes that did not come through
    the gateway fail that one request (SamplingRuleError, a ValueError: report it as
    INVALID_ARGUMENT), never the engine. Zero values keep their wire meaning ("default")."""
    _finite(sp)
    _temperature(sp)
    _top_p(sp, zero_given=False)
    _min_p(sp)
    _repetition_penalty(sp, zero_given=False)
    _logit_bias_ids(sp, vocab_size)
    for bias in sp.logit_bias.values():
        if not math.isfinite(bias):
            raise SamplingRuleError(f"logit_bias must be a finite number, got {bias}", "logit_bias")
    _logprobs(sp, None, "logprobs")
    _prompt_logprobs(sp, None)


# ---- rules shared by check_request and check_engine_sampling --------------------------------
def _finite(sp: Any) -> None:
    for name in _FLOATS:
        value = getattr(sp, name)
        if not math.isfinite(value):
            raise SamplingRuleError(f"{name} must be a finite number, got {value}", name)


def _temperature(sp: Any) -> None:
    if sp.temperature < 0:
        raise SamplingRuleError(f"temperature must be >= 0, got {sp.temperature}", "temperature")


def _top_p(sp: Any, zero_given: bool) -> None:
    if not 0 <= sp.top_p <= 1 or (zero_given and sp.top_p == 0):
        raise SamplingRuleError(f"top_p must be in (0, 1], got {sp.top_p}", "top_p")


def _min_p(sp: Any) -> None:
    if not 0 <= sp.min_p <= 1:
        raise SamplingRuleError(f"min_p must be in [0, 1], got {sp.min_p}", "min_p")


def _repetition_penalty(sp: Any, zero_given: bool) -> None:
    if sp.repetition_penalty < 0 or (zero_given and sp.repetition_penalty == 0):
        raise SamplingRuleError(f"repetition_penalty must be > 0, got {sp.repetition_penalty}",
                                "repetition_penalty")


def _logit_bias_ids(sp: Any, vocab_size: int) -> None:
    for tid in sp.logit_bias:
        if not 0 <= tid < vocab_size:
            raise SamplingRuleError(f"logit_bias has token id {tid}, outside the vocabulary "
                                    f"[0, {vocab_size})", "logit_bias")


def _logprobs(sp: Any, upper: int | None, param: str) -> None:
    """Unset = no logprobs; the gateway also caps the count, the engine only needs >= 0."""
    if not sp.HasField("logprobs"):
        return
    if upper is not None and not 0 <= sp.logprobs <= upper:
        raise SamplingRuleError(f"{param} must be in [0, {upper}], got {sp.logprobs}", param)
    if sp.logprobs < 0:
        raise SamplingRuleError(f"{param} must be >= 0, got {sp.logprobs}", param)


def _prompt_logprobs(sp: Any, upper: int | None) -> None:
    """vLLM's prompt_logprobs: unset = none; the top-N count per prompt position, capped like
    logprobs (vLLM's -1, the whole vocabulary, is refused: it is unbounded work)."""
    if not sp.HasField("prompt_logprobs"):
        return
    if sp.prompt_logprobs < 0 or (upper is not None and sp.prompt_logprobs > upper):
        bound = f"in [0, {upper}]" if upper is not None else ">= 0"
        raise SamplingRuleError(f"prompt_logprobs must be {bound}, got {sp.prompt_logprobs}",
                                "prompt_logprobs")


def _stop_strings(stop: Sequence[str], limits: Limits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise SamplingRuleError(f"at most {limits.max_stop_strings} stop strings are allowed, "
                                f"got {len(stop)}", "stop")
    for s in stop:
        if not s:
            raise SamplingRuleError("stop strings must not be empty", "stop")
        if len(s) > limits.max_stop_string_chars:
            raise SamplingRuleError(f"stop strings must be at most {limits.max_stop_string_chars} "
                                    f"characters, got {len(s)}", "stop")
