"""A gRPC stub on a channel opened lazily, on the serving loop at first use (gateway admin routes)."""
from __future__ import annotations

from collections.abc import Callable

from services.gateway.errors import ApiError


class LazyStub:
    """`stub()` opens the channel the first time; with no address it raises
    ApiError(*missing) instead (missing = (kind, message))."""

    def __init__(self, address: str, credentials, stub_cls: Callable, missing: tuple[str, str]) -> None:
        self.address, self._credentials = address, credentials
        self._stub_cls, self._missing = stub_cls, missing
        self._stub = None

    def stub(self):
        if not self.address:
            raise ApiError(*self._missing)
        if self._stub is None:
            from services.common.grpc_server import channel
            self._stub = self._stub_cls(channel(self.address, credentials=self._credentials))
        return self._stub
