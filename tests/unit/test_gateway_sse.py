"""Streaming output path: folding queued deltas, merged engine outputs, the SSE response."""
import asyncio

from services.common import pb
from services.gateway.clients.output_pipeline import MergedOutput
from services.gateway.clients.request_handle import Delta
from services.gateway.errors import ApiError
from services.gateway.http.sse import SSEResponse, coalesce


def d(text, ids, **kw):
    return Delta(text, list(ids), **kw)


def test_queued_deltas_of_one_choice_fold_into_one_with_the_last_finish():
    out = coalesce([(0, d("Hel", [1])), (0, d("lo", [2], num_cached_tokens=3)),
                    (0, d(" you", [3], finish_reason="stop", stop_reason=7))])
    assert len(out) == 1
    index, delta = out[0]
    assert (index, delta.text, delta.token_ids) == (0, "Hello you", [1, 2, 3])
    assert (delta.finish_reason, delta.stop_reason, delta.num_cached_tokens) == ("stop", 7, 3)
    assert delta.last


def test_choices_fold_separately_and_keep_their_own_order():
    out = coalesce([(0, d("a", [1])), (1, d("x", [9])), (0, d("b", [2])), (1, d("y", [8]))])
    assert [(i, x.text, x.token_ids) for i, x in out] == [(0, "ab", [1, 2]), (1, "xy", [9, 8])]


def test_an_error_delta_is_not_folded_so_the_text_before_it_is_still_sent():
    err = ApiError("cancelled", "request aborted")
    out = coalesce([(0, d("ok", [1])), (0, d("", [], error=err))])
    assert [(x.text, x.error) for _, x in out] == [("ok", None), ("", err)]


def test_nothing_is_folded_into_a_finished_delta():
    out = coalesce([(0, d("end", [1], finish_reason="length")), (0, d("late", [2]))])
    assert [x.text for _, x in out] == ["end", "late"]


def test_logprobs_and_token_strings_are_folded_in_order():
    a = d("a", [1], logprobs=["lp1"], token_strings={1: "a"})
    b = d("b", [2], logprobs=["lp2"], token_strings={2: "b"})
    (_, merged), = coalesce([(0, a), (0, b)])
    assert merged.logprobs == ["lp1", "lp2"] and merged.token_strings == {1: "a", 2: "b"}


def test_merged_engine_outputs_read_like_one_step():
    outs = [pb.engine.RequestOutput(request_id="r", new_token_ids=[5, 6], num_cached_tokens=16,
                                    stop_token_id=-1),
            pb.engine.RequestOutput(request_id="r", new_token_ids=[7], stop_token_id=-1),
            pb.engine.RequestOutput(request_id="r", new_token_ids=[2], stop_token_id=2,
                                    finish_reason=pb.common.FINISH_REASON_STOP)]
    outs[1].logprobs.add(token_id=7, logprob=-0.5)
    m = MergedOutput(outs)
    assert (m.request_id, list(m.new_token_ids), m.num_cached_tokens) == ("r", [5, 6, 7, 2], 16)
    assert (m.finish_reason, m.stop_token_id) == (pb.common.FINISH_REASON_STOP, 2)
    assert [lp.token_id for lp in m.logprobs] == [7]


async def _serve(response: SSEResponse, disconnect_after: float | None):
    """Drive the response like uvicorn: `receive` answers http.disconnect when the client
    leaves, or (as uvicorn does) once the response is complete."""
    sent, complete = [], asyncio.Event()

    async def receive():
        if disconnect_after is None:
            await complete.wait()
        else:
            await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return sent


def test_sse_response_sends_each_item_in_one_body_message_then_ends():
    gone = []

    async def events():
        yield "data: 1\n\n"
        yield "data: 2\n\ndata: [DONE]\n\n"

    sent = asyncio.run(_serve(SSEResponse(events(), lambda: gone.append(1)), None))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n", b""]
    assert sent[-1]["more_body"] is False
    assert gone == []  # the disconnect uvicorn reports after completion is not the client's


def test_sse_response_reports_a_client_that_leaves_mid_stream():
    ended, closed = asyncio.Event(), []

    async def events():
        try:
            yield "data: 1\n\n"
            await ended.wait()          # nothing more until on_disconnect ends the stream
            yield "data: error\n\n"
        finally:
            closed.append(True)

    sent = asyncio.run(_serve(SSEResponse(events(), ended.set), 0.05))
    assert ended.is_set() and closed == [True]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: error\n\n", b""]
