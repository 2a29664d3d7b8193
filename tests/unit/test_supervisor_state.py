"""The supervisor's replica state machine, driven with made-up clock readings."""
import pytest

from services.supervisor.state import Policy, Probe, ProbeResult, ReplicaMachine, State

OK = [ProbeResult(Probe.SERVING)]
NOT = [ProbeResult(Probe.NOT_SERVING, "scheduler no step completed in 31s with work pending")]
GONE = [ProbeResult(Probe.UNREACHABLE, "scheduler 127.0.0.1:1: DEADLINE_EXCEEDED")]


def machine(**kw) -> ReplicaMachine:
    restart_when_unready = kw.pop("restart_when_unready", True)
    policy = Policy(**{"startup_timeout_s": 60, "unhealthy_after_s": 5, "unready_after_s": 10,
                       "backoff_initial_s": 1, "backoff_max_s": 8, "max_restarts": 3,
                       "restart_window_s": 100, **kw})
    m = ReplicaMachine("engine-0", policy, restart_when_unready)
    m.started(0.0)
    return m


def test_a_replica_is_starting_until_its_probe_says_serving_then_ready():
    m = machine()
    assert m.observe(1.0, None, NOT) is None and m.state is State.STARTING
    assert m.observe(2.0, None, OK) is None and m.state is State.READY and m.reason == ""


def test_a_replica_that_never_becomes_ready_fails_after_the_startup_timeout():
    m = machine()
    assert m.observe(59.0, None, GONE) is None
    assert "not ready 60s after start" in m.observe(61.0, None, GONE)


def test_a_dead_process_fails_at_once_and_restarts_with_exponential_backoff():
    m = machine()
    m.observe(1.0, None, OK)
    delays = []
    now = 10.0
    for _ in range(3):
        reason = m.observe(now, "worker (pid 7) killed by SIGKILL", [])
        assert reason == "worker (pid 7) killed by SIGKILL"
        delays.append(m.failed(now, reason))
        assert m.state is State.RESTARTING and "killed by SIGKILL" in m.reason
        assert not m.restart_due(now + delays[-1] - 0.01) and m.restart_due(now + delays[-1])
        m.started(now + delays[-1])
        now += 20
    assert delays == [1, 2, 4] and m.restarts == 3


def test_too_many_restarts_in_the_window_leave_the_replica_dead_with_the_reason():
    m = machine(max_restarts=2)
    for t in (10.0, 20.0):
        m.failed(t, "exited")
        m.started(t + 5)
    assert m.failed(30.0, "worker exited with code 1") is None
    assert m.state is State.DEAD and "gave up after 2 restarts" in m.reason and "code 1" in m.reason
    assert m.observe(31.0, "anything", []) is None  # dead stays dead


def test_restarts_outside_the_window_do_not_count_and_the_backoff_resets():
    m = machine(max_restarts=2, restart_window_s=50)
    for t in (10.0, 20.0):
        m.failed(t, "exited")
        m.started(t + 1)
    assert m.failed(200.0, "exited") == 1  # the earlier restarts are older than the window
    assert m.state is State.RESTARTING


def test_backoff_is_capped():
    assert [Policy(backoff_initial_s=1, backoff_max_s=8).backoff_s(n) for n in range(6)] == [1, 2, 4, 8, 8, 8]


def test_a_hung_process_is_not_ready_at_once_and_failed_after_unhealthy_after_s():
    m = machine()
    m.observe(1.0, None, OK)
    assert m.observe(2.0, None, GONE) is None and m.state is State.NOT_READY
    assert m.observe(6.0, None, GONE) is None
    assert "health check unanswered for 5s" in m.observe(7.0, None, GONE)


def test_an_engine_not_serving_too_long_is_restarted_with_its_reason():
    m = machine()
    m.observe(1.0, None, OK)
    assert m.observe(2.0, None, NOT) is None and m.state is State.NOT_READY
    assert "no step completed" in m.reason
    assert m.observe(11.0, None, NOT) is None
    assert "not ready for 10s: scheduler no step completed" in m.observe(12.0, None, NOT)


def test_a_service_not_serving_is_only_not_ready_without_restart_when_unready():
    m = machine(restart_when_unready=False)
    m.observe(1.0, None, OK)
    assert m.observe(1000.0, None, NOT) is None and m.state is State.NOT_READY
    assert m.observe(1001.0, None, OK) is None and m.state is State.READY


def test_drain_holds_the_state_and_undrain_returns_to_ready():
    m = machine()
    m.observe(1.0, None, OK)
    m.drain(2.0)
    assert m.state is State.DRAINING
    assert m.observe(3.0, None, OK) is None and m.state is State.DRAINING
    # Draining replicas are not restarted for readiness, only for dying or hanging.
    assert m.observe(100.0, None, NOT) is None and m.state is State.DRAINING
    m.observe(101.0, None, OK)
    m.undrain(102.0)
    assert m.state is State.READY


def test_a_restarted_replica_that_was_draining_comes_back_draining():
    m = machine()
    m.observe(1.0, None, OK)
    m.drain(2.0)
    m.failed(3.0, "exited")
    m.started(4.0)
    assert m.state is State.STARTING
    m.observe(5.0, None, OK)
    assert m.state is State.DRAINING


@pytest.mark.parametrize("kw", [{"backoff_initial_s": 10, "backoff_max_s": 1}, {"max_restarts": -1},
                                {"unready_after_s": 0}])
def test_policy_rejects_nonsense(kw):
    with pytest.raises(ValueError):
        Policy(**kw)
