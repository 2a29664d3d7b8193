"""How one engine output ends (or continues) its OpenAI choice: stop strings first, then the
engine's STOP / LENGTH / ERROR / ABORT, and no Delta for an output that adds nothing."""
from services.common import pb
from services.gateway.openai.finish import NOT_FINISHED, finish_of_output


def out(*ids, reason=pb.common.FINISH_REASON_UNSPECIFIED, stop_token_id=-1, **kw):
    return pb.engine.RequestOutput(request_id="r", new_token_ids=ids, finish_reason=reason,
                                   stop_token_id=stop_token_id, **kw)


def test_a_matched_stop_string_ends_with_stop_and_the_string_whatever_the_engine_says():
    for reason in (pb.common.FINISH_REASON_UNSPECIFIED, pb.common.FINISH_REASON_LENGTH):
        end = finish_of_output(out(5, reason=reason), "Hi", "END", {2})
        assert (end.reason, end.stop_reason, end.error, end.flush_held_text) == ("stop", "END", None, False)


def test_engine_stop_on_a_requested_stop_token_reports_that_token_and_flushes_held_text():
    end = finish_of_output(out(7, reason=pb.common.FINISH_REASON_STOP, stop_token_id=7), "", None, {7, 9})
    assert (end.reason, end.stop_reason, end.error, end.flush_held_text) == ("stop", 7, None, True)


def test_engine_stop_on_eos_that_was_not_requested_has_no_stop_reason():
    end = finish_of_output(out(2, reason=pb.common.FINISH_REASON_STOP, stop_token_id=2), "", None, {7})
    assert (end.reason, end.stop_reason, end.flush_held_text) == ("stop", None, True)


def test_length_ends_with_length_and_flushes_held_text():
    end = finish_of_output(out(3, reason=pb.common.FINISH_REASON_LENGTH), "x", None, set())
    assert (end.reason, end.stop_reason, end.error, end.flush_held_text) == ("length", None, None, True)


def test_an_engine_error_becomes_the_api_error_of_its_code():
    o = out(reason=pb.common.FINISH_REASON_ERROR,
            error=pb.common.Error(code=pb.common.ERROR_CODE_INVALID_ARGUMENT, message="prompt too long"))
    end = finish_of_output(o, "", None, set())
    assert end.reason is None and not end.flush_held_text
    assert (end.error.kind, end.error.message) == ("invalid_argument", "prompt too long")


def test_an_engine_abort_is_unavailable_with_a_fresh_error_each_time():
    a = finish_of_output(out(reason=pb.common.FINISH_REASON_ABORT), "", None, set())
    b = finish_of_output(out(reason=pb.common.FINISH_REASON_ABORT), "", None, set())
    assert a.reason is None and a.error.kind == "unavailable"
    assert a.error is not b.error


def test_a_running_output_with_text_or_tokens_continues_and_one_with_neither_gives_no_delta():
    assert finish_of_output(out(4), "", None, set()) is NOT_FINISHED
    assert finish_of_output(out(), "held", None, set()) is NOT_FINISHED
    assert finish_of_output(out(), "", None, set()) is None
