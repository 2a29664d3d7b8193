"""Routing among engine replicas and what requests see when replicas die (simulated workers,
real processes): load spreads, a long prefix sticks to one replica, an engine lost before a
request's first token is invisible to it, one lost after ends the stream with an error at
once, cancellation stops generation within the steps already in flight, and a dead
tokenizer replica is failed over."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.replicamesh import start_replica_mesh

MODEL = "smollm2-135m-instruct"
LONG_PREFIX = "You are a careful assistant who answers in complete sentences. " * 12


def _start(smollm2_dir):
    return start_replica_mesh(str(smollm2_dir), num_engines=2, num_tokenizers=2, step_ms=20,
                              worker_flags=("--simulate-token-ms", "1"),
                              scheduler_flags=("--step-timeout-s", "5"))


def _stop(m) -> None:
    m.stop()
    assert not [p.name for p in m.procs() if p.alive()], "processes left behind"


@pytest.fixture(scope="module")
def shared2(smollm2_dir):
    """Shared by the tests below that leave both engines alive (the last ones in this file
    stop one engine and the tokenizers: they run last, in file order)."""
    m = _start(smollm2_dir)
    yield m
    _stop(m)


@pytest.fixture
def mesh2(smollm2_dir):
    """A fresh mesh for a test that kills engines."""
    m = _start(smollm2_dir)
    yield m
    _stop(m)


def load(addr: str) -> pb.engine.LoadInfo:
    with grpc.insecure_channel(addr) as ch:
        return pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(), timeout=10)


def complete(mesh, prompt: str | list[int], max_tokens: int = 4, **extra) -> dict:
    r = httpx.post(f"{mesh.http_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def served_by(mesh, request_id: str, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not (where := mesh.served_by(request_id)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the scheduler's log line may land just after the response
    return where


def running_on(mesh, timeout_s: float = 10.0) -> int:
    """The replica with a request running (waits until exactly one has)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [i for i, r in enumerate(mesh.replicas) if load(r.addr).num_running]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no single replica is running the request")


def test_load_spreads_and_a_long_prefix_sticks_to_one_replica(shared2):
    mesh2 = shared2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: complete(mesh2, f"question {i}: why?", 8), range(16)))
    counts = [0, 0]
    for out in outs:
        for i in served_by(mesh2, out["id"]):
            counts[i] += 1
    assert sum(counts) == 16 and min(counts) >= 4, counts

    homes = []
    for i in range(5):
        out = complete(mesh2, LONG_PREFIX + f"Question {i}: what is {i} + {i}?")
        homes += served_by(mesh2, out["id"])
        if i:
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert len(homes) == 5 and len(set(homes)) == 1, homes


def long_prompt_request(mesh, seed: int) -> concurrent.futures.Future:
    """A 1500-token prompt (~1.5 s of simulated prefill: no token for a while)."""
    ids = [100 + (seed * 131 + i * 7) % 30000 for i in range(1500)]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(complete, mesh, ids, 6)
    pool.shutdown(wait=False)
    return fut


def test_engine_lost_before_the_first_token_is_retried_on_the_other_replica(mesh2):
    # The worker dies during the prefill: the scheduler answers UNAVAILABLE (or turns not
    # ready); the request runs again on the other replica and the client never knows.
    fut = long_prompt_request(mesh2, 1)
    a = running_on(mesh2)
    mesh2.replicas[a].worker.kill(signal.SIGKILL)
    out = fut.result(timeout=30)
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "length"
    assert served_by(mesh2, out["id"]) == [1 - a]

    # The worker comes back (as a supervisor would restart it): A is routed to again.
    seen = mesh2.times_routable(a)
    mesh2.replicas[a].worker.start()
    deadline = time.monotonic() + 30
    while mesh2.times_routable(a) == seen:
        assert time.monotonic() < deadline, "replica A never became routable again"
        time.sleep(0.1)

    # The scheduler itself dies during the prefill: the EngineStream breaks, same outcome.
    fut = long_prompt_request(mesh2, 2)
    b = running_on(mesh2)
    mesh2.replicas[b].scheduler.kill(signal.SIGKILL)
    out = fut.result(timeout=30)
    assert out["usage"]["completion_tokens"] == 6
    assert served_by(mesh2, out["id"]) == [1 - b]
    assert mesh2.gateway.log().count("resubmitted to") >= 2


def test_engine_lost_after_tokens_ends_the_stream_with_an_error_event(mesh2):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    events, t_kill = [], None
    with httpx.stream("POST", f"{mesh2.http_url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                victim = mesh2.replicas[running_on(mesh2)]
                t_kill = time.monotonic()
                victim.scheduler.kill(signal.SIGKILL)
    elapsed = time.monotonic() - t_kill
    assert elapsed < 5, f"the stream took {elapsed:.1f}s to end after the engine died"
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "engine" in error["message"]
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert not any(finishes), "a broken stream must not look like a finished one"

    # gRPC: the same failure is UNAVAILABLE. The survivor is the only replica now.
    survivor = next(r for r in mesh2.replicas if r.scheduler.alive())
    with grpc.insecure_channel(mesh2.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        req = pb.generation.GenerateRequest(model=MODEL, text="Tell me a story.",
                                            sampling=pb.common.SamplingParams(max_tokens=2000,
                                                                              ignore_eos=True))
        got, code = 0, None
        try:
            for _ in stub.Generate(req, timeout=30):
                got += 1
                if got == 3:
                    survivor.scheduler.kill(signal.SIGKILL)
        except grpc.RpcError as err:
            code = err.code()
    assert code == grpc.StatusCode.UNAVAILABLE

    # No replica left: a clear 503, not a hang.
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(f"{mesh2.http_url}/v1/completions", timeout=10,
                       json={"model": MODEL, "prompt": "anyone?", "max_tokens": 2})
        if r.status_code == 503 and "no engine replica" in r.json()["error"]["message"]:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def test_cancelled_requests_stop_within_the_steps_in_flight(shared2):
    mesh2 = shared2
    before = [load(r.addr) for r in mesh2.replicas]
    body = {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        def stream_then_leave(i: int) -> int:
            got = 0
            with httpx.stream("POST", f"{mesh2.http_url}/v1/completions", timeout=30,
                              json={**body, "prompt": f"story {i}"}) as r:
                for line in r.iter_lines():
                    got += line.startswith("data: ")
                    if got >= 4:
                        return got  # closing the response disconnects mid-stream
            return got
        assert all(n >= 4 for n in pool.map(stream_then_leave, range(6)))
    deadline = time.monotonic() + 10
    while any(load(r.addr).num_running or load(r.addr).num_waiting for r in mesh2.replicas):
        assert time.monotonic() < deadline, "requests kept running after their clients left"
        time.sleep(0.05)
    loads = [load(r.addr) for r in mesh2.replicas]
    aborts = sum(x.aborts - y.aborts for x, y in zip(loads, before))
    after = sum(x.tokens_after_abort - y.tokens_after_abort for x, y in zip(loads, before))
    assert aborts == 6
    # Async scheduling: the step running and the one queued behind it, one token each.
    assert after <= 2 * aborts, (after, aborts)


def test_sigterm_drains_a_replica_without_failing_a_request(shared2):
    # A long stream runs on X; X's scheduler gets SIGTERM: readiness false, new requests
    # (including any it refuses while shutting down) go to Y, the stream on X finishes.
    mesh2 = shared2
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", f"{mesh2.http_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                x = running_on(mesh2)
                mesh2.replicas[x].scheduler.popen.send_signal(signal.SIGTERM)
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    outs = list(pool.map(lambda i: complete(mesh2, f"during drain {i}"), range(8)))
                assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
                assert all(served_by(mesh2, o["id"]) == [1 - x] for o in outs)
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length" and "error" not in events[-2]
    mesh2.replicas[x].scheduler.popen.wait(30)  # it exits once its stream finished


def test_a_dead_tokenizer_replica_is_failed_over(shared2):
    mesh2 = shared2
    assert complete(mesh2, "before")["usage"]["completion_tokens"] == 4
    for tok in mesh2.tokenizers:  # whichever is active, one dies and the other serves
        t0 = time.monotonic()
        tok.kill(signal.SIGKILL)
        if tok is mesh2.tokenizers[-1]:
            break
        for i in range(3):
            out = complete(mesh2, f"after {i}")
            assert out["usage"]["completion_tokens"] == 4
        assert time.monotonic() - t0 < 15
    r = httpx.post(f"{mesh2.http_url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "no tokenizer", "max_tokens": 2})
    assert r.status_code == 503, r.text
