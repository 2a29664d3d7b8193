"""The gateway's side of the sampling rulebook (services/common/sampling_rules.py).

The rules live there, shared with the worker; here a broken rule becomes the gateway's 400 /
INVALID_ARGUMENT with the rule's own message and param, and the Limits come from the engine's
info and the gateway's flags."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from services.common import pb
from services.common import sampling_rules as rules
from services.common.sampling_rules import Limits
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, invalid

_Rule = TypeVar("_Rule", bound=Callable)


def _api_errors(rule: _Rule) -> _Rule:
    @functools.wraps(rule)
    def checked(*args, **kwargs):
        try:
            return rule(*args, **kwargs)
        except rules.SamplingRuleError as err:
            raise invalid(err.message, err.param) from None
    return checked  # type: ignore[return-value]


check_request = _api_errors(rules.check_request)
fit_to_prompt = _api_errors(rules.fit_to_prompt)
check_token_ids = _api_errors(rules.check_token_ids)
check_int32 = _api_errors(rules.check_int32)


def engine_limits(info: "pb.engine.EngineInfo | None", config: GatewayConfig) -> Limits:
    if info is None:
        raise ApiError("unavailable", "the engine is not reachable yet; try again shortly")
    return Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                  max_stop_strings=config.max_stop_strings,
                  max_stop_string_chars=config.max_stop_string_chars)
