"""Process failures under the supervisor, on a real mesh (simulated worker: no model compute).

Each test breaks one process the way production does (kill -9, SIGSTOP, SIGTERM) while a
stream is in flight and checks four things: what the in-flight request received (an error
event, never a hang or a silently short success), that a new request succeeds within a
bounded time, that the supervisor restarted the right replica (ListReplicas restart counts),
and that the broken processes are gone. The module's teardown checks that no process of the
mesh, restarted ones included, outlives it."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.meshproc import alive, service_name, start_mesh, stop_checked

RECOVERY_S = 45       # generous: CI is slower than this machine
STREAM_END_S = 30     # an in-flight stream must end (with an error) well before its own length


@pytest.fixture(scope="module")
def mesh(smollm2_dir):
    # 20 ms steps: a 1500-token stream lasts ~30 s, far longer than any failure below takes.
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--simulate-step-ms", "20", "--max-model-len", "2048",
                   "--progress-timeout-s", "2", "--shutdown-grace-s", "10")
    m.seen = set(m.service_pids())
    yield m
    stop_checked(m, m.seen)


def replicas(mesh) -> dict[str, pb.supervisor.Replica]:
    with grpc.insecure_channel(mesh.services()["supervisor"]) as ch:
        rs = pb.supervisor_grpc.SupervisorStub(ch).ListReplicas(pb.supervisor.ListReplicasRequest(), timeout=10)
    return {r.id: r for r in rs.replicas}


class Stream:
    """A streaming completion read on a thread: tokens seen, and how it ended."""

    def __init__(self, mesh, max_tokens: int = 1500) -> None:
        self.chunks, self.error, self.finish, self.exc, self.ended_at = 0, None, None, None, None
        self.started = threading.Event()
        body = {"model": mesh.model_name, "prompt": "Tell me a story.", "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}
        self._thread = threading.Thread(target=self._run, args=(mesh.http_url, body), daemon=True)
        self._thread.start()
        assert self.started.wait(30), f"the stream produced no tokens: {self.exc or self.error}"

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    self.chunks += 1
                    self.finish = event["choices"][0].get("finish_reason") or self.finish
                    if self.chunks >= 3:
                        self.started.set()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.exc = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def wait(self, timeout_s: float) -> "Stream":
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the in-flight stream hung for {timeout_s}s after the failure"
        return self


def wait_recovered(mesh, replica_id: str, restarts_before: int) -> tuple[pb.supervisor.Replica, list[str]]:
    """Until the supervisor reports the replica READY after one more restart; returns it and
    every (state: reason) seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + RECOVERY_S
    while time.monotonic() < deadline:
        r = replicas(mesh)[replica_id]
        line = f"{pb.supervisor.ReplicaState.Name(r.state)}: {r.reason}"
        if not seen or seen[-1] != line:
            seen.append(line)
        if r.state == pb.supervisor.REPLICA_STATE_READY and r.restarts > restarts_before:
            mesh.seen |= set(mesh.service_pids())
            return r, seen
        time.sleep(0.1)
    raise AssertionError(f"{replica_id} not restarted and ready in {RECOVERY_S}s: {seen}")


def completes(mesh) -> float:
    """Seconds until a new request succeeds (retrying while the mesh recovers)."""
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < RECOVERY_S:
        try:
            r = httpx.post(f"{mesh.http_url}/v1/completions", timeout=30,
                           json={"model": mesh.model_name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                return time.monotonic() - t0
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise AssertionError(f"no request succeeded within {RECOVERY_S}s of the failure: {last}")


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def assert_error_not_success(s: Stream) -> None:
    assert s.error is not None, f"expected an error event, got finish={s.finish} after {s.chunks} chunks ({s.exc})"
    assert s.finish is None, "a cut stream must not end as a success"


def test_kill_9_worker_mid_stream(mesh):
    engine = replicas(mesh)["engine-0"]
    worker, scheduler = engine.pids
    assert service_name(worker) == "worker" and service_name(scheduler) == "scheduler"
    s = Stream(mesh)
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    s.wait(STREAM_END_S)
    assert_error_not_success(s)
    assert s.ended_at - t0 < 15, "the stream should end promptly once its engine died"
    r, seen = wait_recovered(mesh, "engine-0", engine.restarts)
    assert r.restarts == engine.restarts + 1
    assert any("worker" in line and "SIGKILL" in line for line in seen), seen
    assert gone(scheduler), "the dead worker's scheduler must be replaced too"
    assert set(r.pids).isdisjoint({worker, scheduler})
    completes(mesh)
    others = replicas(mesh)
    assert others["tokenizer-0"].restarts == 0 and others["gateway-0"].restarts == 0


def test_sigstop_worker_is_caught_by_the_progress_check(mesh):
    engine = replicas(mesh)["engine-0"]
    worker, scheduler = engine.pids
    s = Stream(mesh)
    os.kill(worker, signal.SIGSTOP)
    try:
        s.wait(STREAM_END_S)
        assert_error_not_success(s)
        r, seen = wait_recovered(mesh, "engine-0", engine.restarts)
        # The scheduler's progress check said why; the supervisor acted on it.
        assert any("no step completed" in line for line in seen), seen
        assert gone(worker), "the supervisor kills the hung worker (SIGKILL works on a stopped process)"
        assert gone(scheduler)
        completes(mesh)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGCONT)
            os.kill(worker, signal.SIGKILL)


def test_kill_9_tokenizer_replica(mesh):
    before = replicas(mesh)
    tok = before["tokenizer-0"]
    s = Stream(mesh)
    os.kill(tok.pids[0], signal.SIGKILL)
    s.wait(STREAM_END_S)
    # The detokenizer's incremental state died with it: the stream ends with an error
    # (or, if it had just finished its last detokenize, completes) but never hangs.
    assert s.error is not None or s.finish == "length"
    r, _ = wait_recovered(mesh, "tokenizer-0", tok.restarts)
    assert r.restarts == tok.restarts + 1 and gone(tok.pids[0])
    completes(mesh)
    assert replicas(mesh)["engine-0"].restarts == before["engine-0"].restarts, "only the tokenizer restarts"


def test_kill_9_scheduler_mid_stream(mesh):
    engine = replicas(mesh)["engine-0"]
    worker, scheduler = engine.pids
    s = Stream(mesh)
    os.kill(scheduler, signal.SIGKILL)
    s.wait(STREAM_END_S)
    assert_error_not_success(s)
    r, seen = wait_recovered(mesh, "engine-0", engine.restarts)
    assert any("scheduler" in line and "SIGKILL" in line for line in seen), seen
    assert gone(worker), "the worker held the dead scheduler's requests: it restarts with it"
    completes(mesh)


def test_sigterm_scheduler_finishes_in_flight_then_exits_and_is_restarted(mesh):
    engine = replicas(mesh)["engine-0"]
    worker, scheduler = engine.pids
    s = Stream(mesh, max_tokens=60)    # ~1.2 s of steps: well inside the 10 s grace
    os.kill(scheduler, signal.SIGTERM)
    s.wait(STREAM_END_S)
    assert s.error is None and s.finish == "length", f"in-flight request cut: {s.error or s.exc}"
    assert gone(scheduler, 15), "the scheduler must exit once its in-flight work is done"
    r, _ = wait_recovered(mesh, "engine-0", engine.restarts)
    assert gone(worker)
    completes(mesh)


def test_watch_drain_undrain_and_metrics(mesh):
    with grpc.insecure_channel(mesh.services()["supervisor"]) as ch:
        stub = pb.supervisor_grpc.SupervisorStub(ch)
        watch = stub.WatchReplicas(pb.supervisor.WatchReplicasRequest(kind=pb.supervisor.REPLICA_KIND_ENGINE),
                                   timeout=30)
        first = next(watch)
        assert [r.id for r in first.replicas] == ["engine-0"]
        drained = stub.Drain(pb.supervisor.DrainRequest(replica_id="engine-0"), timeout=10)
        assert drained.state == pb.supervisor.REPLICA_STATE_DRAINING
        change = next(watch)   # the full set again, newer
        assert change.version > first.version
        assert change.replicas[0].state == pb.supervisor.REPLICA_STATE_DRAINING
        undrained = stub.Undrain(pb.supervisor.DrainRequest(replica_id="engine-0"), timeout=10)
        assert undrained.state == pb.supervisor.REPLICA_STATE_READY
        watch.cancel()
        with pytest.raises(grpc.RpcError) as err:
            stub.Drain(pb.supervisor.DrainRequest(replica_id="engine-9"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    completes(mesh)
    text = httpx.get(f"http://{mesh.services()['supervisor-metrics']}/metrics", timeout=10).text
    restarts = [line for line in text.splitlines()
                if line.startswith('meshllm:supervisor_restarts_total{kind="engine",replica="engine-0"}')]
    assert restarts and float(restarts[0].split()[-1]) == replicas(mesh)["engine-0"].restarts, restarts
    assert 'meshllm:supervisor_replica_state{kind="engine",replica="engine-0",state="ready"} 1.0' in text
