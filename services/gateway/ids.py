"""Request ids: the ones the gateway makes, and the client-supplied ones it accepts."""
from __future__ import annotations

import re
import uuid

_SANE_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sane_client_id(value: str | None) -> str | None:
    """A client-supplied request id we are willing to echo back and log, else None."""
    return value if value and _SANE_ID.match(value) else None
