"""`--api-server-count 2`: two gateway processes on one HTTP and one gRPC port (SO_REUSEPORT),
a /metrics that counts both whichever one a scrape lands on, every process answering health,
one restarted alone by the supervisor, and both gone when the launcher stops. One mesh with the
simulated worker for the module."""
from __future__ import annotations

import json
import os
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from services.common import pb
from services.gateway.shared_metrics import SYNC_INTERVAL_S
from tests.integration.meshproc import alive, service_name, start_mesh, stop_checked

MODEL = "smollm2-135m-instruct"
CLOSE = {"Connection": "close"}   # a new connection per request: the kernel picks a process each time


@pytest.fixture(scope="module")
def mesh2(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--simulate-step-ms", "1", "--no-kv-tier",
                   "--api-server-count", "2", "--max-model-len", "512")
    m.seen = set(m.service_pids())
    yield m
    if m.proc.poll() is None:
        stop_checked(m, m.seen)


def listening_pids(mesh, port: int) -> set[int]:
    """The mesh's processes with a listening TCP socket on `port` (read from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    pids = set()
    for pid in mesh.service_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    pids.add(pid)
                    break
            except OSError:
                continue
    return pids


def gateway_pids(mesh) -> set[int]:
    return {p for p in mesh.service_pids() if service_name(p) == "gateway" and alive(p)}


def metrics_dir(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return env[b"PROMETHEUS_MULTIPROC_DIR"].decode()


def counted_by(pid: int, path: str, name: str, **labels) -> float:
    """What one process counted (its own multiprocess counter file)."""
    total = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(os.path.join(path, f"counter_{pid}.db")):
        _, sample, sample_labels, _ = json.loads(key)
        if sample == name and all(sample_labels.get(k) == v for k, v in labels.items()):
            total += value
    return total


def scrape(mesh) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{mesh.http_url}/metrics", headers=CLOSE, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(snap: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in snap.items() if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def complete(client: httpx.Client, prompt: str) -> None:
    r = client.post("/v1/completions", headers=CLOSE,
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_two_gateway_processes_listen_on_the_http_and_grpc_ports(mesh2):
    gateways = gateway_pids(mesh2)
    assert len(gateways) == 2
    assert listening_pids(mesh2, mesh2.http_port) == gateways
    assert listening_pids(mesh2, mesh2.grpc_port) == gateways
    with grpc.insecure_channel(mesh2.services()["supervisor"]) as ch:
        replicas = pb.supervisor_grpc.SupervisorStub(ch).ListReplicas(pb.supervisor.ListReplicasRequest(),
                                                                      timeout=10).replicas
    states = {r.id: r.state for r in replicas if r.kind == pb.supervisor.REPLICA_KIND_GATEWAY}
    assert states == {"gateway-0": pb.supervisor.REPLICA_STATE_READY, "gateway-1": pb.supervisor.REPLICA_STATE_READY}


def test_requests_reach_both_processes_and_metrics_count_them_all(mesh2):
    gateways = gateway_pids(mesh2)
    path = metrics_dir(next(iter(gateways)))
    before = {pid: counted_by(pid, path, "meshllm:http_requests_total", route="/v1/completions") for pid in gateways}
    sent = 30
    with httpx.Client(base_url=mesh2.http_url, timeout=30) as c:
        for i in range(sent):
            complete(c, f"request {i}")
    served = {pid: counted_by(pid, path, "meshllm:http_requests_total", route="/v1/completions") - before[pid]
              for pid in gateways}
    assert sum(served.values()) == sent
    assert all(n > 0 for n in served.values()), served
    # Whichever process a scrape lands on, it counts every request of both (the engine pool's
    # view, read at scrape time, is copied from a sibling at most SYNC_INTERVAL_S late).
    time.sleep(SYNC_INTERVAL_S + 0.5)
    for _ in range(6):
        snap = scrape(mesh2)
        assert total(snap, "meshllm:http_requests_total", route="/v1/completions", status="200") == sent
        assert total(snap, "meshllm:http_request_duration_seconds_count", route="/v1/completions") == sent
        assert total(snap, "meshllm:gateway_routed_requests_total") >= sent
        assert total(snap, "meshllm:engine_replica_routable", replica="engine-0") == 1
        assert {n for n, _ in snap if n.startswith("meshllm:engine_replica_routable")} == {
            "meshllm:engine_replica_routable"}
        assert [dict(ls) for n, ls in snap if n == "meshllm:engine_replica_routable"] == [{"replica": "engine-0"}]


def test_grpc_is_served_by_both_processes_on_the_shared_port(mesh2):
    gateways = gateway_pids(mesh2)
    path = metrics_dir(next(iter(gateways)))

    def generates(pid):
        return counted_by(pid, path, "meshllm:grpc_server_requests_total", method="Generate", code="OK")
    before = {pid: generates(pid) for pid in gateways}
    sent = 16
    for i in range(sent):   # a channel per call: a new connection each time
        with grpc.insecure_channel(mesh2.grpc_addr) as ch:
            stub = pb.generation_grpc.GenerationStub(ch)
            outs = list(stub.Generate(pb.generation.GenerateRequest(
                model=MODEL, text=f"grpc {i}", sampling=pb.common.SamplingParams(max_tokens=3)), timeout=30))
            assert outs and outs[-1].finish_reason
    served = {pid: generates(pid) - before[pid] for pid in gateways}
    assert sum(served.values()) == sent and all(n > 0 for n in served.values()), served
    assert total(scrape(mesh2), "meshllm:grpc_server_requests_total", service="gateway", method="Generate",
                 code="OK") == sum(before.values()) + sent


def test_every_process_answers_health(mesh2):
    services = mesh2.services()
    for addr in (services["gateway-health"], services["gateway-health-1"]):
        with grpc.insecure_channel(addr) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="gateway"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with httpx.Client(base_url=mesh2.http_url, timeout=10) as c:
        assert all(c.get("/health", headers=CLOSE).status_code == 200 for _ in range(10))


def test_a_killed_gateway_process_is_restarted_alone_and_the_totals_hold(mesh2):
    with httpx.Client(base_url=mesh2.http_url, timeout=30) as c:
        complete(c, "before the kill")
    before = total(scrape(mesh2), "meshllm:http_requests_total", route="/v1/completions", status="200")
    victim, survivor = sorted(gateway_pids(mesh2))
    os.kill(victim, signal.SIGKILL)
    # Connections the kernel queued on the victim's socket before it closed are lost with it
    # (SO_REUSEPORT keeps no queue of a dead listener): send once it is gone.
    while alive(victim):
        time.sleep(0.01)
    with httpx.Client(base_url=mesh2.http_url, timeout=30) as c:
        for i in range(5):   # the survivor takes every connection meanwhile
            complete(c, f"during the restart {i}")
    deadline = time.monotonic() + 30
    while len(gateway_pids(mesh2) - {victim}) < 2 or listening_pids(mesh2, mesh2.http_port) != gateway_pids(mesh2):
        assert time.monotonic() < deadline, "the killed gateway process was not restarted"
        time.sleep(0.2)
    mesh2.seen |= set(mesh2.service_pids())
    assert survivor in gateway_pids(mesh2)
    # The killed process's counts stay in the total; its in-flight gauges are dropped.
    snap = scrape(mesh2)
    assert total(snap, "meshllm:http_requests_total", route="/v1/completions", status="200") == before + 5
    assert total(snap, "meshllm:gateway_requests_inflight") == 0


def test_stopping_the_launcher_stops_every_gateway_process(mesh2):
    gateways = gateway_pids(mesh2)
    assert len(gateways) == 2
    path = metrics_dir(next(iter(gateways)))
    stop_checked(mesh2, mesh2.seen)
    assert not any(alive(p) for p in gateways)
    assert not os.path.exists(path), "the launcher left the gateways' metrics directory behind"
