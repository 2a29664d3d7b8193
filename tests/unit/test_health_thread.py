"""grpc.health.v1 served from threads (services/common/health_thread.py): it answers, with the
verdict of the moment, while the caller's event loop is wedged."""
import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb
from services.common.health_thread import start_health_server


def test_health_answers_from_its_own_threads_while_the_event_loop_is_blocked():
    state = {"ready": False}
    server, port = start_health_server("127.0.0.1", 0, ["scheduler"],
                                       lambda: (state["ready"], "ready" if state["ready"] else "no step in 31s"))
    answers = []

    def probe() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = hpb_grpc.HealthStub(ch)
            for _ in range(3):
                t0 = time.monotonic()
                status = stub.Check(hpb.HealthCheckRequest(service="scheduler"), timeout=2).status
                answers.append((status, time.monotonic() - t0))
                state["ready"] = True
            reason = pb.health_grpc.StatusStub(ch).GetStatus(pb.health.StatusRequest(), timeout=2).reason
            answers.append(reason)

    async def wedged_loop() -> None:
        t = threading.Thread(target=probe)
        t.start()
        time.sleep(1.5)   # the loop is stuck: nothing else on it runs meanwhile
        t.join(5)

    try:
        asyncio.run(wedged_loop())
        assert [a[0] for a in answers[:3]] == [hpb.HealthCheckResponse.NOT_SERVING, hpb.HealthCheckResponse.SERVING,
                                               hpb.HealthCheckResponse.SERVING]
        assert answers[3] == "ready"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = hpb_grpc.HealthStub(ch)
            assert stub.Check(hpb.HealthCheckRequest(service=""), timeout=2).status == hpb.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                stub.Check(hpb.HealthCheckRequest(service="nope"), timeout=2)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(None)


def test_gateway_vitals_turn_not_ready_when_its_event_loop_stalls_and_when_stopping():
    from services.gateway import main as gateway_main
    vitals = gateway_main._Vitals()
    vitals.ready, vitals.reason = True, "ready"
    assert vitals.verdict() == (True, "ready")
    vitals.tick -= gateway_main.LOOP_STALL_S + 1     # the readiness task has not run since
    ready, reason = vitals.verdict()
    assert not ready and reason.startswith("event loop stalled")
    vitals.tick = time.monotonic()
    vitals.stopping = True
    assert vitals.verdict() == (False, "stopping")
