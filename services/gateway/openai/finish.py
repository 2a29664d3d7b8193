"""How one engine output of a request ends its OpenAI choice. Pure: no I/O, no clocks.

A request ends on the earliest of: a stop string the gateway matched in the text (the
engine never sees stop strings), the engine's own STOP (EOS or a stop token id) or LENGTH,
an engine ERROR, or an ABORT by the engine. `finish_of_output` makes that decision for
each output; the request handle builds the Delta from it."""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from services.common import pb
from services.common.finish import ABORT, ERROR, LENGTH, STOP, from_proto
from services.gateway.errors import ApiError

_UNSPECIFIED = pb.common.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True, slots=True)
class Finish:
    """What the Delta of one output says about the end of its request."""

    reason: str | None = None             # "stop" | "length"; None while running or failed
    stop_reason: str | int | None = None  # the stop string, or the stop token id that ended it
    error: ApiError | None = None         # the request failed
    flush_held_text: bool = False         # emit the text held back for a possible stop string


# The request goes on: one shared value, so the per-step path allocates nothing here.
NOT_FINISHED = Finish()


def finish_of_output(out, text: str, stop_string: str | None,
                     stop_token_ids: Container[int]) -> Finish | None:
    """`out`: a pb.engine.RequestOutput or a MergedOutput; `text`: its text after stop
    strings; `stop_string`: the stop string matched so far (StopStringMatcher.stopped).

    Returns None when the output adds nothing (no text, no token, no finish): no Delta."""
    if stop_string is not None:
        return Finish(STOP, stop_string)
    reason = out.finish_reason
    if reason != _UNSPECIFIED:
        name = from_proto(reason)
        if name == STOP or name == LENGTH:
            # Only a stop token id the request asked for is a stop_reason (not EOS by itself).
            stop_token = out.stop_token_id if out.stop_token_id in stop_token_ids else None
            return Finish(name, stop_token, flush_held_text=True)
        if name == ERROR:
            return Finish(error=ApiError.from_engine(out.error))
        if name == ABORT:  # a fresh error each time: a raised exception keeps its traceback
            return Finish(error=ApiError("unavailable", "the engine aborted the request"))
    return NOT_FINISHED if text or out.new_token_ids else None
