"""The kvstore in the launched mesh (the shared session mesh): `meshllm serve` starts it under
the supervisor by default, tells the engines where it is, and the supervisor restarts it after
kill -9 while the mesh keeps serving."""
from __future__ import annotations

import os
import signal
import time

import grpc
import httpx

from services.common import pb
from services.common.kv_blocks import kv_pb2
from services.common.kv_client import KvClient
from tests.integration.meshproc import service_name

RECOVERY_S = 45
NS = kv_pb2.KvNamespace(model_id="mesh-test", block_size=16, num_layers=1, tp_size=1, block_bytes=4096)


def _kvstore_replica(mesh) -> "pb.supervisor.Replica":
    with grpc.insecure_channel(mesh.services()["supervisor"]) as ch:
        rs = pb.supervisor_grpc.SupervisorStub(ch).ListReplicas(pb.supervisor.ListReplicasRequest(), timeout=10)
    kv = [r for r in rs.replicas if r.kind == pb.supervisor.REPLICA_KIND_KVSTORE]
    assert len(kv) == 1, [r.id for r in rs.replicas]
    return kv[0]


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0")]


def test_the_mesh_runs_a_kvstore_and_tells_the_engines(mesh):
    addr = mesh.services()["kvstore"]
    replica = _kvstore_replica(mesh)
    assert replica.addr == addr and replica.state == pb.supervisor.REPLICA_STATE_READY
    engines = [p for p in mesh.service_pids() if service_name(p) in ("scheduler", "worker")]
    assert len(engines) >= 2
    for pid in engines:
        argv = _cmdline(pid)
        assert argv[argv.index("--kvstore-addr") + 1] == addr, service_name(pid)
    client = KvClient(addr)
    try:
        assert client.put(NS, [(b"mesh-1", os.urandom(4096))]) == 1 and client.lookup(NS, [b"mesh-1"]) == 1
    finally:
        client.close()


def test_the_supervisor_restarts_a_killed_kvstore_while_the_mesh_serves(mesh):
    before = _kvstore_replica(mesh)
    client = KvClient(before.addr, timeout_s=0.5, max_retry_after_s=1.0)
    data = os.urandom(4096)
    try:
        assert client.put(NS, [(b"mesh-2", data)]) == 1
        (pid,) = before.pids
        assert service_name(pid) == "kvstore"
        os.kill(pid, signal.SIGKILL)
        # The engines do not depend on the tier: a request completes meanwhile.
        r = httpx.post(f"{mesh.http_url}/v1/completions", timeout=60,
                       json={"model": mesh.model_name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + RECOVERY_S
        while True:
            now = _kvstore_replica(mesh)
            if now.state == pb.supervisor.REPLICA_STATE_READY and now.restarts > before.restarts:
                break
            assert time.monotonic() < deadline, f"kvstore not restarted: {now.state} {now.reason}"
            time.sleep(0.2)
        assert now.addr == before.addr and set(now.pids).isdisjoint(before.pids)
        # A new process: the old blocks are gone (host memory), the client uses it again.
        while client.put(NS, [(b"mesh-3", data)]) != 1:
            assert time.monotonic() < deadline, "the restarted kvstore was not used again"
            time.sleep(0.2)
        assert client.lookup(NS, [b"mesh-2"]) == 0 and client.get(NS, [b"mesh-3"]) == [data]
    finally:
        client.close()
