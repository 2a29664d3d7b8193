"""Tokens produced after an abort reached the scheduler (services/scheduler/abort_tracker.py)."""
from dataclasses import dataclass

from services.scheduler.abort_tracker import AbortTracker


@dataclass
class Sampled:
    request_id: str
    token_ids: list


def test_counts_only_the_steps_in_flight_when_the_abort_arrived():
    t = AbortTracker("t1", pipeline_depth=2)
    t.on_plan(1)
    t.on_plan(2)                                   # steps 1 and 2 are in flight
    t.on_abort(["r"], live={"r"})
    t.on_result(1, [Sampled("r", [5]), Sampled("s", [6])])
    t.on_plan(3)                                   # planned after the abort: without r
    t.on_result(2, [Sampled("r", [7])])
    t.on_result(3, [Sampled("s", [8])])
    assert (t.aborts, t.tokens_after_abort) == (1, 2)
    t.on_result(4, [Sampled("s", [9])])
    assert not t._watch                            # forgotten once no step can hold it


def test_a_request_that_keeps_running_is_caught():
    t = AbortTracker("t2", pipeline_depth=1)
    t.on_plan(1)
    t.on_abort(["r"], live={"r"})
    for step in (1, 2):                            # a broken abort: r still in step 2
        t.on_result(step, [Sampled("r", [1])])
    assert t.tokens_after_abort == 2 > t.aborts * t.pipeline_depth


def test_aborts_of_finished_requests_are_free():
    t = AbortTracker("t3")
    t.on_abort(["gone"], live=set())
    t.on_result(0, [Sampled("gone", [1])])
    assert (t.aborts, t.tokens_after_abort) == (0, 0)
