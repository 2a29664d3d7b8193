"""Checks on SamplingParams and prompts shared by the HTTP and gRPC APIs.

Bad input stops here with a 400 / INVALID_ARGUMENT and never reaches the engine."""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.common import pb
from services.gateway.errors import invalid

MAX_LOGPROBS = 20
MAX_N = 16  # choices per request (each is its own engine request)
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 1024      # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 64
# cache_salt goes into the prefix-cache hash; printable, no spaces, so logs stay one line.
_CACHE_SALT = re.compile(r"^[A-Za-z0-9._:@/+=\-]*$")


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 32
    max_stop_string_chars: int = 512
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {value}", name)


def validate_sampling(sp: "pb.common.SamplingParams", limits: Limits) -> None:
    """Range checks in the engine's terms (zero means "default" for most fields)."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        _finite(name, getattr(sp, name))
    if sp.temperature < 0:
        raise invalid(f"temperature must be >= 0, got {sp.temperature}", "temperature")
    if not 0 <= sp.top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {sp.top_p}", "top_p")
    if sp.top_k < -1:
        raise invalid(f"top_k must be -1 (disabled) or at least 1, got {sp.top_k}", "top_k")
    if not 0 <= sp.min_p <= 1:
        raise invalid(f"min_p must be in [0, 1], got {sp.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sp, name) <= 2:
            raise invalid(f"{name} must be in [-2, 2], got {getattr(sp, name)}", name)
    if sp.repetition_penalty < 0:
        raise invalid(f"repetition_penalty must be > 0, got {sp.repetition_penalty}",
                      "repetition_penalty")
    if sp.max_tokens < 0:
        raise invalid(f"max_tokens must be at least 1, got {sp.max_tokens}", "max_tokens")
    if sp.min_tokens < 0:
        raise invalid(f"min_tokens must be >= 0, got {sp.min_tokens}", "min_tokens")
    if sp.HasField("logprobs") and not 0 <= sp.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], got {sp.logprobs}", "logprobs")
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise invalid(f"at most {limits.max_stop_token_ids} stop_token_ids are allowed, "
                      f"got {len(sp.stop_token_ids)}", "stop_token_ids")
    if len(sp.logit_bias) > limits.max_logit_bias:
        raise invalid(f"logit_bias may have at most {limits.max_logit_bias} entries, "
                      f"got {len(sp.logit_bias)}", "logit_bias")
    for tid in sp.stop_token_ids:
        if not 0 <= tid < limits.vocab_size:
            raise invalid(f"stop_token_ids contains {tid}, outside the vocabulary "
                          f"[0, {limits.vocab_size})", "stop_token_ids")
    for tid, bias in sp.logit_bias.items():
        if not 0 <= tid < limits.vocab_size:
            raise invalid(f"logit_bias has token id {tid}, outside the vocabulary "
                          f"[0, {limits.vocab_size})", "logit_bias")
        if not -100 <= bias <= 100:
            raise invalid(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
    if len(sp.stop) > limits.max_stop_strings:
        raise invalid(f"at most {limits.max_stop_strings} stop strings are allowed, "
                      f"got {len(sp.stop)}", "stop")
    for s in sp.stop:
        if not s:
            raise invalid("stop strings must not be empty", "stop")
        if len(s) > limits.max_stop_string_chars:
            raise invalid(f"stop strings must be at most {limits.max_stop_string_chars} "
                          f"characters, got {len(s)}", "stop")


def validate_prompt(prompt_ids: Sequence[int], limits: Limits, param: str = "prompt") -> None:
    if not prompt_ids:
        raise invalid("the prompt is empty: it must contain at least one token", param)
    for tid in prompt_ids:
        if not 0 <= tid < limits.vocab_size:
            raise invalid(f"token id {tid} is outside the vocabulary [0, {limits.vocab_size})",
                          param)
    if len(prompt_ids) >= limits.max_model_len:
        raise invalid(f"This model's maximum context length is {limits.max_model_len} tokens. "
                      f"However, your prompt has {len(prompt_ids)} tokens, which leaves no "
                      f"room for a completion. Please reduce the length of the prompt.", param)


def resolve_max_tokens(sp: "pb.common.SamplingParams", prompt_len: int, limits: Limits) -> None:
    """Fill in max_tokens (0 = up to the context) and apply vLLM's context rule."""
    room = limits.max_model_len - prompt_len
    if sp.max_tokens == 0:
        sp.max_tokens = room
    elif prompt_len + sp.max_tokens > limits.max_model_len:
        raise invalid(f"This model's maximum context length is {limits.max_model_len} tokens. "
                      f"However, you requested {prompt_len + sp.max_tokens} tokens "
                      f"({prompt_len} in the prompt, {sp.max_tokens} in the completion). "
                      f"Please reduce the length of the prompt or of the completion.",
                      "max_tokens")
    if sp.min_tokens > sp.max_tokens:
        raise invalid(f"min_tokens ({sp.min_tokens}) must not exceed max_tokens "
                      f"({sp.max_tokens})", "min_tokens")


def validate_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise invalid(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
                      f"got {len(salt)}", "cache_salt")
    if not _CACHE_SALT.match(salt):
        raise invalid("cache_salt may only contain [A-Za-z0-9._:@/+=-]", "cache_salt")


def validate_priority(priority: int) -> None:
    if not -(2 ** 31) <= priority < 2 ** 31:
        raise invalid(f"priority must fit in a signed 32-bit integer, got {priority}",
                      "priority")
