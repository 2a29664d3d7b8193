"""`meshllm serve --data-parallel-size 2` under the supervisor: the gateway follows its
replica set, and an admin Drain moves new traffic to the other replica while the drained
one finishes what it has (no failed request); Undrain brings it back."""
from __future__ import annotations

import concurrent.futures
import json
import re
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.meshproc import alive, start_mesh

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def dp_mesh(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--simulate-step-ms", "20",
                   "--data-parallel-size", "2")
    pids = m.service_pids()
    yield m
    assert m.stop() == 0
    assert not [p for p in pids if alive(p)], "services left running after the launcher stopped"


def routable(mesh) -> dict[str, float]:
    text = httpx.get(f"{mesh.http_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^meshllm:engine_replica_routable\{replica="([^"]+)"\} (\S+)$', text, re.M)}


def wait_routable(mesh, want: dict[str, float], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := routable(mesh)) != want:
        assert time.monotonic() < deadline, f"routable {got}, want {want}"
        time.sleep(0.1)


def queries(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(),
                                                     timeout=10).prefix_cache_queries


def complete(mesh, prompt: str) -> dict:
    r = httpx.post(f"{mesh.http_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()


def test_drain_moves_new_requests_and_finishes_the_running_ones(dp_mesh):
    svc = dp_mesh.services()
    addrs = {"engine-0": svc["scheduler"], "engine-1": svc["scheduler-1"]}
    wait_routable(dp_mesh, {"engine-0": 1.0, "engine-1": 1.0})
    sup = grpc.insecure_channel(svc["supervisor"])
    stub = pb.supervisor_grpc.SupervisorStub(sup)
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 80, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", f"{dp_mesh.http_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                busy = [rid for rid, a in addrs.items() if _running(a)]
                assert len(busy) == 1, busy
                drained, other = busy[0], next(k for k in addrs if k != busy[0])
                state = stub.Drain(pb.supervisor.DrainRequest(replica_id=drained), timeout=10)
                assert state.state == pb.supervisor.REPLICA_STATE_DRAINING
                wait_routable(dp_mesh, {drained: 0.0, other: 1.0})
                before = {k: queries(a) for k, a in addrs.items()}
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda i: complete(dp_mesh, f"while draining {i}"), range(8)))
                after = {k: queries(a) for k, a in addrs.items()}
                assert after[drained] == before[drained], "a drained replica got new requests"
                assert after[other] > before[other]
    # The stream that was running on the drained replica finished normally.
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

    stub.Undrain(pb.supervisor.DrainRequest(replica_id=drained), timeout=10)
    wait_routable(dp_mesh, {"engine-0": 1.0, "engine-1": 1.0})
    before = queries(addrs[drained])
    for i in range(4):  # equal loads alternate: the undrained replica gets its share again
        complete(dp_mesh, f"after undrain {i}")
    assert queries(addrs[drained]) > before
    sup.close()


def _running(addr: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        load = pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(), timeout=10)
    return load.num_running > 0
