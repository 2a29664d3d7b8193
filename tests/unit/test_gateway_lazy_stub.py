"""The admin routes' lazily opened gRPC stubs: no address -> the route's own ApiError, every call."""
import pytest

from services.common import pb
from services.gateway.errors import ApiError
from services.gateway.clients.lazy_stub import LazyStub


def test_without_an_address_each_call_raises_the_configured_error():
    s = LazyStub("", None, pb.supervisor_grpc.SupervisorStub, ("conflict", "no supervisor here"))
    for _ in range(2):
        with pytest.raises(ApiError) as err:
            s.stub()
        assert err.value.kind == "conflict" and err.value.message == "no supervisor here"
