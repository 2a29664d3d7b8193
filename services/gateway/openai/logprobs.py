"""Engine TokenLogprobs -> OpenAI logprobs shapes (chat and legacy completions).

Token strings are decode([id]) from the tokenizer (sent with the step's Detokenize
message); a token that is part of a multi-byte character shows as U+FFFD, as in vLLM."""
from __future__ import annotations

from collections.abc import Sequence


def token_id_strings(lps: Sequence) -> dict[int, str]:
    """vLLM's return_tokens_as_token_ids: every logprob token (chosen and top) shown as
    "token_id:<id>", so tokens that are no valid text stay identifiable."""
    return {i: f"token_id:{i}" for lp in lps for i in (lp.token_id, *(t.token_id for t in lp.top))}


def _entry(token_id: int, logprob: float, strings: dict[int, str]) -> dict:
    token = strings.get(token_id, "")
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode("utf-8"))}


def chat_content(lps: Sequence, strings: dict[int, str]) -> list[dict]:
    """[{token, logprob, bytes, top_logprobs: [...]}] for `choices[i].logprobs.content`."""
    out = []
    for lp in lps:
        item = _entry(lp.token_id, lp.logprob, strings)
        item["top_logprobs"] = [_entry(t.token_id, t.logprob, strings) for t in lp.top]
        out.append(item)
    return out


class CompletionLogprobs:
    """Legacy completions logprobs; text_offset counts characters from the start of the
    choice's text (after the echoed prompt, if any)."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def chunk(self, lps: Sequence, strings: dict[int, str]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            token = strings.get(lp.token_id, "")
            out["tokens"].append(token)
            out["token_logprobs"].append(max(lp.logprob, -9999.0))
            top = {strings.get(t.token_id, ""): max(t.logprob, -9999.0) for t in lp.top}
            top.setdefault(token, max(lp.logprob, -9999.0))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out


def merge_completion(parts: Sequence[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out
