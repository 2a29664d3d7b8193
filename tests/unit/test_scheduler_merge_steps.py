"""Steps queued for a slow gateway go out as one OutputBatch with one output per request."""
from services.scheduler.core import FinishReason, RequestOutput
from services.scheduler.server import merge_steps


def test_each_request_gets_its_tokens_in_order_and_its_last_finish():
    s1 = [RequestOutput("a", [1]), RequestOutput("b", [7], num_cached_tokens=16)]
    s2 = [RequestOutput("a", [2], logprobs=["lp2"]), RequestOutput("c", [9])]
    s3 = [RequestOutput("a", [3], FinishReason.STOP, stop_token_id=3), RequestOutput("b", [8])]
    out = {o.request_id: o for o in merge_steps([s1, s2, s3])}
    assert list(out) == ["a", "b", "c"]
    assert (out["a"].new_token_ids, out["a"].logprobs) == ([1, 2, 3], ["lp2"])
    assert (out["a"].finish_reason, out["a"].stop_token_id) == (FinishReason.STOP, 3)
    assert (out["b"].new_token_ids, out["b"].num_cached_tokens, out["b"].finish_reason) == ([7, 8], 16, None)
    assert out["c"].new_token_ids == [9]


def test_the_core_outputs_are_not_changed_by_merging():
    first = RequestOutput("a", [1])
    merge_steps([[first], [RequestOutput("a", [2])]])
    assert first.new_token_ids == [1]


def test_a_finished_request_is_not_merged_with_a_later_one_under_the_same_id():
    out = merge_steps([[RequestOutput("a", [1], FinishReason.LENGTH)], [RequestOutput("a", [5])]])
    assert [(o.new_token_ids, o.finish_reason) for o in out] == [([1], FinishReason.LENGTH), ([5], None)]
