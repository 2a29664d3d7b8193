"""vLLM's prompt truncation (`truncate_prompt_tokens`, `truncation_side`), shared by the HTTP
routes and gRPC Generate. Pure: token ids in, token ids out; the prompt is cut before the
rulebook's fit_to_prompt, so a truncated prompt is held to the context like any other."""
from __future__ import annotations

from collections.abc import Sequence

from services.gateway.errors import invalid

SIDES = ("left", "right")


def check_truncation(keep: int | None, side: str | None, max_model_len: int,
                     param: str = "truncate_prompt_tokens") -> None:
    """400 for what truncate_prompt would refuse, before any tokenizer work: `keep` is -1 (the
    context length) or 1..max_model_len (above it is a 400, as vLLM answers), `side` is
    "left" or "right" and needs `keep`."""
    if side is not None and side not in SIDES:
        raise invalid(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")
    if keep is None:
        if side is not None:
            raise invalid("truncation_side needs truncate_prompt_tokens", "truncation_side")
        return
    if keep == 0 or keep < -1:
        raise invalid(f"{param} must be -1 (the context length) or a positive count, got {keep}",
                      param)
    if max_model_len and keep > max_model_len:
        raise invalid(f"{param} ({keep}) is greater than the context length ({max_model_len}): "
                      "choose a smaller one", param)


def truncate_prompt(prompt_ids: Sequence[int], keep: int | None, side: str | None,
                    max_model_len: int, param: str = "truncate_prompt_tokens") -> list[int]:
    """The prompt cut to `keep` tokens (-1: the context length; None: uncut). Side "left"
    (the default, as vLLM) drops the start and keeps the last `keep` tokens; "right" keeps the
    first ones."""
    check_truncation(keep, side, max_model_len, param)
    ids = list(prompt_ids)
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if len(ids) <= keep:
        return ids
    return ids[-keep:] if side in (None, "left") else ids[:keep]
