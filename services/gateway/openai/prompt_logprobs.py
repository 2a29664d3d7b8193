"""Prompt logprobs (engine PromptLogprob messages, one per prompt position >= 1) in the two public
shapes:

- vLLM's `prompt_logprobs` (completions: on each choice; chat: on the response): a list as long
  as the prompt, null first (nothing predicts the first token), then per position a dict
  token id (a string, JSON keys are) -> {"logprob", "rank", "decoded_token"} holding the prompt's
  own token and the top N there (so N or N + 1 entries).
- OpenAI's legacy completions `echo` with `logprobs`: the prompt's tokens, token_logprobs,
  top_logprobs and text_offset before the completion's, token_logprobs[0] and top_logprobs[0]
  null (as OpenAI and vLLM answer).

Token strings are decode([id]) from the tokenizer, sent with the Detokenize message of the output
that carried them (request_handle.py); -inf (a token the model rules out) is clamped to -9999.0
as the output logprobs are, so the JSON stays valid."""
from __future__ import annotations

from collections.abc import Sequence

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


def string_ids(prompt_ids: Sequence[int], lps: Sequence) -> set[int]:
    """Every id whose string the formats below need: the first prompt token and, per position,
    the prompt's token and its top N."""
    ids = {lp.token_id for lp in lps}
    ids.update(t.token_id for lp in lps for t in lp.top)
    if prompt_ids:
        ids.add(prompt_ids[0])
    return ids


def vllm_prompt_logprobs(prompt_len: int, lps: Sequence, strings: dict[int, str]) -> list[dict | None]:
    """vLLM's shape: [None, {id: {logprob, rank, decoded_token}}, ...] (prompt_len entries when
    the engine scored every position)."""
    out: list[dict | None] = [None] if prompt_len else []
    for lp in lps:
        entry = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                    "decoded_token": strings.get(lp.token_id, "")}}
        for rank, t in enumerate(lp.top, start=1):
            entry.setdefault(str(t.token_id), {"logprob": _lp(t.logprob), "rank": rank,
                                               "decoded_token": strings.get(t.token_id, "")})
        out.append(entry)
    return out


def echo_completion_logprobs(prompt_ids: Sequence[int], lps: Sequence,
                             strings: dict[int, str]) -> tuple[dict, int]:
    """The echoed prompt's part of a completions `logprobs` object, and the text offset the
    completion's tokens continue from (the prompt tokens' string lengths, summed)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if not prompt_ids:
        return out, 0
    by_position = {lp.position: lp for lp in lps}
    offset = 0
    for position, token_id in enumerate(prompt_ids):
        token = strings.get(token_id, "")
        lp = by_position.get(position)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if lp is None:   # position 0 (or one the engine did not score)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(lp.logprob))
        top = {strings.get(t.token_id, ""): _lp(t.logprob) for t in lp.top}
        top.setdefault(token, _lp(lp.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def prepend(echo_part: dict, completion: dict | None) -> dict:
    """The echoed prompt's logprobs followed by the completion's (None: none yet)."""
    if completion is None:
        return echo_part
    return {key: echo_part[key] + completion[key] for key in echo_part}


class PromptPart:
    """One choice's prompt logprobs: kept from its first Delta (the engine sends them once, on
    the first-token output), formatted on demand."""

    def __init__(self, prompt_ids: Sequence[int], tokens_as_ids: bool = False) -> None:
        self.prompt_ids = list(prompt_ids)
        self.tokens_as_ids = tokens_as_ids   # vLLM's return_tokens_as_token_ids: "token_id:<id>"
        self.lps: list = []
        self.strings: dict[int, str] = {}
        self.received = False

    def take(self, delta) -> bool:
        """Keep the prompt logprobs of the choice's first Delta (the engine's first-token output
        carries them; a one-token prompt has none); True for that Delta."""
        if self.received or delta.error is not None:
            return False
        self.lps, self.received = list(delta.prompt_logprobs), True
        ids = string_ids(self.prompt_ids, self.lps)
        self.strings = ({i: f"token_id:{i}" for i in ids} if self.tokens_as_ids
                        else {i: delta.token_strings.get(i, "") for i in ids})
        return True

    def vllm(self) -> list[dict | None]:
        return vllm_prompt_logprobs(len(self.prompt_ids), self.lps, self.strings)

    def echo(self) -> tuple[dict, int]:
        return echo_completion_logprobs(self.prompt_ids, self.lps, self.strings)
