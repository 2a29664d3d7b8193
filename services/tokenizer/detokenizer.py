"""Incremental detokenization (vLLM / TGI style): token ids in, text deltas out.

Per request we keep a short window of ids and two offsets into it:

    ids:  [ ... already emitted ... | last emitted chunk | not yet emitted ]
          0                 prefix_offset        read_offset         len(ids)

Each step decodes ids[prefix_offset:read_offset] and ids[prefix_offset:] and emits the
difference. Decoding with the previous chunk as context keeps what a decoder does at the
start of a string (SentencePiece strips the first leading space) from eating spaces, and
a difference ending in "\\ufffd" (a UTF-8 character split across tokens) is held back until
the next token completes it. Ids before prefix_offset are dropped, so memory per request
stays small. For byte-level BPE, concatenating every delta gives `decode(all ids)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# Prompt ids used as decoding context for the first output token (vLLM uses 5).
PREFIX_CONTEXT_IDS = 5
# A split UTF-8 character needs at most 3 more bytes; a longer run still ending in
# "\ufffd" is invalid bytes that will never complete, so stop holding (and stop the
# window, which is re-decoded every step, from growing without bound).
MAX_HELD_TOKENS = 16
DEFAULT_MAX_REQUESTS = 65536

Decode = Callable[[list[int], bool], str]   # (ids, skip_special_tokens) -> text


class DetokenizerFullError(RuntimeError):
    """Too many unfinished requests: refuse new ones (RESOURCE_EXHAUSTED)."""


@dataclass
class DecodeState:
    ids: list[int]
    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool


def new_state(decode: Decode, prefix_token_ids: Sequence[int], skip_special_tokens: bool) -> DecodeState:
    prefix = list(prefix_token_ids)[-PREFIX_CONTEXT_IDS:]
    # Context that itself ends inside a UTF-8 character would make the first delta wrong.
    if prefix and decode(prefix, skip_special_tokens).endswith("\ufffd"):
        prefix = []
    return DecodeState(ids=prefix, prefix_offset=0, read_offset=len(prefix),
                       skip_special_tokens=skip_special_tokens)


def decode_step(decode: Decode, state: DecodeState, new_token_ids: Sequence[int],
                finished: bool = False) -> str:
    """Append `new_token_ids` to `state` and return the text they complete."""
    state.ids.extend(new_token_ids)
    if len(state.ids) == state.read_offset:
        return ""
    skip = state.skip_special_tokens
    prefix_text = decode(state.ids[state.prefix_offset:state.read_offset], skip)
    new_text = decode(state.ids[state.prefix_offset:], skip)
    held_tokens = len(state.ids) - state.read_offset
    if len(new_text) <= len(prefix_text):
        return ""  # e.g. only skipped special tokens so far
    if new_text.endswith("\ufffd") and not finished and held_tokens < MAX_HELD_TOKENS:
        return ""
    delta = new_text[len(prefix_text):]
    # The chunk just emitted becomes the next step's context; older ids are not needed.
    del state.ids[:state.read_offset]
    state.prefix_offset, state.read_offset = 0, len(state.ids)
    return delta


class IncrementalDetokenizer:
    """Decode states for many requests, bounded by `max_requests`, dropped on finish."""

    def __init__(self, decode: Decode, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if max_requests <= 0:
            raise ValueError("max_requests must be positive")
        self._decode = decode
        self.max_requests = max_requests
        self._states: dict[str, DecodeState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def step(self, request_id: str, new_token_ids: Sequence[int], *,
             prefix_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
             finished: bool = False) -> str:
        """Text delta for `request_id`'s new ids. `prefix_token_ids` and
        `skip_special_tokens` count only on a request's first step; `finished` flushes
        held-back text and forgets the request."""
        state = self._states.get(request_id)
        if state is None:
            if not finished and len(self._states) >= self.max_requests:
                raise DetokenizerFullError(
                    f"too many unfinished detokenize requests (max {self.max_requests})")
            state = new_state(self._decode, prefix_token_ids, skip_special_tokens)
            if not finished:
                self._states[request_id] = state
        try:
            return decode_step(self._decode, state, new_token_ids, finished)
        finally:
            if finished:
                self._states.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def clear(self) -> None:
        self._states.clear()
