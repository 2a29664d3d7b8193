"""The scheduler's readiness verdict (services/scheduler/health.py), with made-up times."""
from services.scheduler.health import EngineVitals


def ready_vitals() -> EngineVitals:
    v = EngineVitals(progress_timeout_s=30)
    v.loop_alive = True
    v.set_worker(True, "ready")
    return v


def test_not_ready_until_the_worker_said_hello_and_the_loop_runs():
    v = EngineVitals(progress_timeout_s=30)
    assert v.verdict(0) == (False, "the engine loop is not running")
    v.loop_alive = True
    assert v.verdict(0) == (False, "waiting for the worker")
    v.set_worker(True, "ready")
    assert v.verdict(0) == (True, "ready")
    v.set_worker(False, "worker lost: no answer in 120s")
    assert v.verdict(0) == (False, "worker lost: no answer in 120s")


def test_pending_work_without_a_completed_step_turns_not_ready_after_the_timeout():
    v = ready_vitals()
    v.note_pending(True, now=100.0)
    assert v.verdict(129.0)[0]
    ok, reason = v.verdict(131.0)
    assert not ok and reason == "no step completed in 31s with work pending"
    v.step_done(now=131.5)
    assert v.verdict(132.0) == (True, "ready")


def test_an_idle_engine_stays_ready_however_long_since_its_last_step():
    v = ready_vitals()
    v.step_done(now=0.0)
    v.note_pending(False)
    assert v.verdict(10_000.0) == (True, "ready")
    # Work arriving after the idle hour starts a fresh clock.
    v.note_pending(True, now=10_000.0)
    assert v.verdict(10_010.0) == (True, "ready")


def test_draining_is_never_ready():
    v = ready_vitals()
    v.draining = True
    assert v.verdict(0) == (False, "shutting down: finishing in-flight requests")
