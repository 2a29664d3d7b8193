"""`meshllm serve --data-parallel-size 2` under the supervisor: the gateway follows its
replica set, and an admin Drain moves new traffic to the other replica while the drained
one finishes what it has (no failed request); Undrain brings it back. The gateway's admin
routes do the same over HTTP (POST /drain) and flush every replica's prefix cache
(POST /reset_prefix_cache); both need the admin key."""
from __future__ import annotations

import concurrent.futures
import json
import re
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.gateway_proc import start_gateway
from tests.integration.meshproc import alive, start_mesh

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-key-h6b-0001"
USER = "user-key-h6b-0001"
AS_USER = {"Authorization": f"Bearer {USER}"}
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def dp_mesh(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--simulate-step-ms", "20",
                   "--data-parallel-size", "2", "--api-key", USER, "--admin-api-key", ADMIN)
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
    r = httpx.post(f"{mesh.http_url}/v1/completions", timeout=60, headers=AS_USER,
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
    with httpx.stream("POST", f"{dp_mesh.http_url}/v1/completions", json=body, timeout=30,
                      headers=AS_USER) as r:
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


# ---- admin routes over HTTP ------------------------------------------------------------------

def admin_post(mesh, path: str, headers=AS_ADMIN, **kw) -> httpx.Response:
    return httpx.post(f"{mesh.http_url}{path}", headers=headers, timeout=30, **kw)


def test_admin_routes_refuse_users_and_anonymous_callers(dp_mesh):
    for path in ("/reset_prefix_cache", "/drain"):
        for headers in ({}, AS_USER, {"Authorization": "Bearer not-a-key-at-all"}):
            r = admin_post(dp_mesh, path, headers=headers, json={"replica": "engine-0"})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"


def cached_tokens(mesh, prompt: str) -> int:
    usage = complete(mesh, prompt)["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_reset_prefix_cache_flushes_every_replica(dp_mesh):
    wait_routable(dp_mesh, {"engine-0": 1.0, "engine-1": 1.0})
    prompt = "The quick brown fox jumps over the lazy dog. " * 12   # ~130 tokens: 8 full blocks
    cached_tokens(dp_mesh, prompt)
    warm = cached_tokens(dp_mesh, prompt)   # prefix affinity: the same replica, now a hit
    assert warm >= 64, warm

    r = admin_post(dp_mesh, "/reset_prefix_cache")
    assert r.status_code == 200, r.text
    body = r.json()
    assert {o["replica"]: o["status"] for o in body["replicas"]} == {"engine-0": "ok", "engine-1": "ok"}
    assert body["num_blocks_flushed"] == sum(o["num_blocks_flushed"] for o in body["replicas"])
    assert body["num_blocks_flushed"] >= warm // 16

    assert cached_tokens(dp_mesh, prompt) == 0, "the flushed prefix was still served from the cache"
    assert cached_tokens(dp_mesh, prompt) >= warm, "the cache did not fill again after the flush"


def test_grpc_reset_prefix_cache_is_admin_only(dp_mesh):
    with grpc.insecure_channel(dp_mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        req = pb.generation.PrefixCacheResetRequest()
        for key in (None, USER):
            with pytest.raises(grpc.RpcError) as err:
                stub.ResetPrefixCache(req, timeout=30,
                                      metadata=[("authorization", f"Bearer {key}")] if key else None)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.ResetPrefixCache(req, timeout=30, metadata=[("authorization", f"Bearer {ADMIN}")])
    assert sorted(r.replica for r in reply.replicas) == ["engine-0", "engine-1"]
    assert all(r.status == "ok" for r in reply.replicas)
    assert reply.num_blocks_flushed == sum(r.num_blocks_flushed for r in reply.replicas)


def test_reset_prefix_cache_leaves_running_requests_alone(dp_mesh):
    body = {"model": MODEL, "prompt": "A long story about a lighthouse keeper. " * 8, "max_tokens": 40,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{dp_mesh.http_url}/v1/completions", json=body, timeout=30,
                      headers=AS_USER) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 2:
                r2 = admin_post(dp_mesh, "/reset_prefix_cache")
                assert r2.status_code == 200, r2.text
                # The running request's full blocks stay cached (it holds them).
                assert max(o["num_blocks_cached"] for o in r2.json()["replicas"]) >= 4, r2.text
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def replica_state(mesh, replica_id: str) -> int:
    with grpc.insecure_channel(mesh.services()["supervisor"]) as ch:
        rs = pb.supervisor_grpc.SupervisorStub(ch).ListReplicas(pb.supervisor.ListReplicasRequest(), timeout=10)
    return next(r.state for r in rs.replicas if r.id == replica_id)


def test_drain_over_http_moves_traffic_and_undrain_restores_it(dp_mesh):
    svc = dp_mesh.services()
    wait_routable(dp_mesh, {"engine-0": 1.0, "engine-1": 1.0})
    for bad, status in (({}, 400), ({"replica": ""}, 400), ({"replica": "engine-1", "extra": 1}, 400),
                        ({"replica": "engine-1", "undrain": "maybe"}, 400), ({"replica": "engine-9"}, 404)):
        r = admin_post(dp_mesh, "/drain", json=bad)
        assert r.status_code == status, (bad, r.text)
    assert admin_post(dp_mesh, "/drain").status_code == 400       # no body at all

    r = admin_post(dp_mesh, "/drain", json={"replica": "engine-1"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "engine-1" and r.json()["state"] == "REPLICA_STATE_DRAINING"
    assert replica_state(dp_mesh, "engine-1") == pb.supervisor.REPLICA_STATE_DRAINING
    wait_routable(dp_mesh, {"engine-0": 1.0, "engine-1": 0.0})
    before = {k: queries(svc[k]) for k in ("scheduler", "scheduler-1")}
    for i in range(4):
        complete(dp_mesh, f"drained over http {i}")
    assert queries(svc["scheduler-1"]) == before["scheduler-1"], "the drained replica got new requests"
    assert queries(svc["scheduler"]) > before["scheduler"]

    r = admin_post(dp_mesh, "/drain", json={"replica": "engine-1", "undrain": True})
    assert r.status_code == 200, r.text
    assert r.json()["state"] in ("REPLICA_STATE_READY", "REPLICA_STATE_STARTING")
    wait_routable(dp_mesh, {"engine-0": 1.0, "engine-1": 1.0})
    assert replica_state(dp_mesh, "engine-1") == pb.supervisor.REPLICA_STATE_READY


def test_a_gateway_without_a_supervisor_cannot_drain_but_can_flush(dp_mesh):
    gw = start_gateway(dp_mesh, "--admin-api-key", ADMIN)   # static --engine-addr, no supervisor
    try:
        url = f"http://127.0.0.1:{gw.http_port}"
        r = httpx.post(f"{url}/drain", headers=AS_ADMIN, json={"replica": "engine-0"}, timeout=30)
        assert r.status_code == 409, r.text
        assert "--supervisor-addr" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/reset_prefix_cache", headers=AS_ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        [only] = r.json()["replicas"]
        assert only["status"] == "ok" and only["address"] == dp_mesh.services()["scheduler"]
    finally:
        gw.stop()
