"""Admission keeps no more than a sweep's worth of finished requests (their handles)."""
from services.gateway.guard.admission import SWEEP_EVERY, Admission


def test_finished_requests_do_not_pile_up_to_the_limit():
    adm = Admission(max_requests=100_000, max_tokens=10**9)
    live = {"keep"}
    adm.hold("keep", 10, lambda: "keep" in live)
    for i in range(5 * SWEEP_EVERY):
        adm.check(1, 10)
        adm.hold(f"r{i}", 10, lambda: False)   # finished as soon as it is held
    assert adm.num_requests <= SWEEP_EVERY
    assert adm.tokens == 10 * adm.num_requests
    live.clear()
    for i in range(SWEEP_EVERY):
        adm.hold(f"s{i}", 1, lambda: False)
    assert "keep" not in adm._held
