"""How a request ended: the one mapping between the wire enum pb.common.FinishReason and the
names every service uses ("stop", "length", "abort", "error", as the OpenAI API spells the
first two). The scheduler core, the gateway's engine client and its public gRPC API all
convert through here, so a new reason is added in one place."""
from __future__ import annotations

from services.common import pb

STOP = "stop"        # EOS, a stop token id or a stop string
LENGTH = "length"    # max_tokens or the context length
ABORT = "abort"      # aborted by the client, the gateway or the engine
ERROR = "error"      # failed; the output carries a pb.common.Error

_TO_PROTO: dict[str, int] = {
    STOP: pb.common.FINISH_REASON_STOP,
    LENGTH: pb.common.FINISH_REASON_LENGTH,
    ABORT: pb.common.FINISH_REASON_ABORT,
    ERROR: pb.common.FINISH_REASON_ERROR,
}
_FROM_PROTO: dict[int, str] = {value: name for name, value in _TO_PROTO.items()}


def to_proto(name: str | None) -> int:
    """The wire value of a finish name; None (still running) is FINISH_REASON_UNSPECIFIED."""
    if name is None:
        return pb.common.FINISH_REASON_UNSPECIFIED
    try:
        return _TO_PROTO[name]
    except KeyError:
        raise ValueError(f"unknown finish reason {name!r}") from None


def from_proto(value: int) -> str | None:
    """The finish name of a wire value; None while running (and for a value this build does
    not know, which a newer peer may send: the request is then treated as still running)."""
    return _FROM_PROTO.get(value)
