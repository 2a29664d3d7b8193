"""The one finish-reason mapping: every name goes to its wire value and back."""
import pytest

from services.common import finish, pb


def test_every_finish_name_round_trips_through_the_wire_enum():
    names = [finish.STOP, finish.LENGTH, finish.ABORT, finish.ERROR]
    values = [finish.to_proto(n) for n in names]
    assert values == [pb.common.FINISH_REASON_STOP, pb.common.FINISH_REASON_LENGTH,
                      pb.common.FINISH_REASON_ABORT, pb.common.FINISH_REASON_ERROR]
    assert [finish.from_proto(v) for v in values] == names


def test_every_wire_value_round_trips_through_its_name():
    for value in pb.common.FinishReason.values():
        assert finish.to_proto(finish.from_proto(value)) == value


def test_a_running_request_is_unspecified_on_the_wire():
    assert finish.to_proto(None) == pb.common.FINISH_REASON_UNSPECIFIED
    assert finish.from_proto(pb.common.FINISH_REASON_UNSPECIFIED) is None


def test_an_unknown_name_is_refused_and_an_unknown_wire_value_reads_as_running():
    with pytest.raises(ValueError, match="bogus"):
        finish.to_proto("bogus")
    assert finish.from_proto(99) is None
