"""Internal hops locked down: `meshllm serve --internal-mtls DIR` (gRPC mTLS between services,
CURVE on the scheduler <-> worker ZMQ link). A request still works end to end; a gRPC client
without a certificate, with one from another CA or an expired one is refused by every internal
port; a ZMQ peer without the right key never gets a plan processed."""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import grpc
import pytest
import requests
import zmq
import zmq.auth
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb
from services.common.devca import issue, load_or_make_ca, make_ca, write_dev_ca
from services.common.procs import die_with_parent
from tests.integration.meshproc import ROOT, alive, start_mesh
from tests.worker_driver import MiniScheduler

NO_REPLY_S = 2.0  # a CURVE-accepted peer gets its reply in milliseconds


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("internal-tls")
    write_dev_ca(str(out))  # every service the launcher may start
    return out


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """A client certificate from an unrelated CA (valid in every other respect)."""
    out = tmp_path_factory.mktemp("other-ca")
    ca = make_ca("some other CA")
    ca.write(str(out), "ca")
    issue(ca, "client").write(str(out), "client")
    return out


@pytest.fixture(scope="module")
def expired(certs, tmp_path_factory):
    """A client certificate from the mesh CA that expired days ago."""
    out = tmp_path_factory.mktemp("expired")
    ca, _ = load_or_make_ca(str(certs))
    issue(ca, "client", days=1, valid_from_days=-10).write(str(out), "client")
    return out


@pytest.fixture(scope="module")
def locked(smollm2_dir, certs):
    m = start_mesh(str(smollm2_dir), "--simulate-worker", "--max-model-len", "512",
                   "--internal-mtls", str(certs))
    pids = m.service_pids()
    yield m
    assert m.stop() == 0
    assert not [p for p in pids if alive(p)]


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _health(addr: str, credentials: grpc.ChannelCredentials | None) -> int:
    """grpc.health.v1 liveness over a plain (None) or TLS channel; raises grpc.RpcError."""
    ch = (grpc.secure_channel(addr, credentials) if credentials is not None
          else grpc.insecure_channel(addr))
    with ch:
        return hpb_grpc.HealthStub(ch).Check(hpb.HealthCheckRequest(service=""), timeout=5).status


def test_a_request_works_end_to_end_over_mtls_and_curve(locked):
    r = requests.post(f"{locked.http_url}/v1/completions", timeout=60,
                      json={"model": locked.model_name, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert requests.get(f"{locked.http_url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("service", ["tokenizer", "scheduler", "worker-health", "profiler", "supervisor",
                                     "gateway-health"])
def test_internal_grpc_ports_refuse_clients_without_a_valid_certificate_from_the_mesh_ca(
        locked, certs, other_ca, expired, service):
    addr = locked.services()[service]
    ca = _read(certs / "ca.pem")
    right = grpc.ssl_channel_credentials(ca, _read(certs / "client.key"), _read(certs / "client.pem"))
    assert _health(addr, right) == hpb.HealthCheckResponse.SERVING  # the port works, with a cert
    refused = {
        "plain": None,
        "tls without a client certificate": grpc.ssl_channel_credentials(ca),
        "certificate from another CA": grpc.ssl_channel_credentials(
            ca, _read(other_ca / "client.key"), _read(other_ca / "client.pem")),
        "expired certificate from the mesh CA": grpc.ssl_channel_credentials(
            ca, _read(expired / "client.key"), _read(expired / "client.pem")),
    }
    for why, creds in refused.items():
        with pytest.raises(grpc.RpcError) as info:
            _health(addr, creds)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, why


def _dealer(ctx: zmq.Context, addr: str, client_secret: str | None, server_public: str | None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if client_secret:
        public, secret = zmq.auth.load_certificate(client_secret)
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_serverkey, _ = zmq.auth.load_certificate(server_public)
    sock.connect(addr)
    return sock


def _hello(sock) -> pb.step.WorkerReply | None:
    sock.send(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=16)).SerializeToString())
    if not sock.poll(int(NO_REPLY_S * 1000)):
        return None
    reply = pb.step.WorkerReply()
    reply.ParseFromString(sock.recv())
    return reply


def _stranger_key(tmp_path) -> str:
    _, secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
    return secret


def test_zmq_peers_without_the_schedulers_key_get_nothing_from_the_mesh_worker(locked, certs, tmp_path):
    addr = locked.services()["worker"]
    ctx = zmq.Context()
    try:
        for secret in (None, _stranger_key(tmp_path)):
            sock = _dealer(ctx, addr, secret, str(certs / "curve" / "worker.key"))
            assert _hello(sock) is None, f"the worker answered a peer with key {secret}"
            sock.close(0)
    finally:
        ctx.destroy(linger=0)  # closes sockets an assertion left open, never blocks
    test_a_request_works_end_to_end_over_mtls_and_curve(locked)  # the real scheduler still is served


@pytest.fixture(scope="module")
def curve_worker(smollm2_dir, certs):
    """A simulated worker on TCP with CURVE, alone, so a peer with the right key can show that
    the same plan *would* be processed."""
    cmd = [sys.executable, "-m", "services.worker", "--model", str(smollm2_dir), "--simulate",
           "--zmq-addr", "tcp://127.0.0.1:0", "--grpc-port", "0", "--num-kv-blocks", "64",
           "--zmq-curve-secret-key", str(certs / "curve" / "worker.key_secret"),
           "--zmq-curve-clients", str(certs / "curve" / "clients")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_INTERNAL_TLS_")}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=env, preexec_fn=die_with_parent)
    try:
        deadline, line = time.monotonic() + 60, ""
        while "worker listening" not in line:
            assert proc.poll() is None and time.monotonic() < deadline, "the worker did not start"
            if select.select([proc.stdout], [], [], 1.0)[0]:  # never block past the deadline
                line = proc.stdout.readline()
        yield re.search(r"zmq=(\S+)", line).group(1)
    finally:
        proc.terminate()
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()


def test_only_the_allowed_key_gets_a_plan_processed(curve_worker, certs, tmp_path):
    ctx = zmq.Context()
    server_public = str(certs / "curve" / "worker.key")
    try:
        for secret in (None, _stranger_key(tmp_path)):
            sock = _dealer(ctx, curve_worker, secret, server_public)
            plan = pb.step.StepPlan(step_id=0)
            plan.new_requests.add(request_id="r", token_ids=[1, 2, 3], block_ids=[0], num_computed_tokens=0,
                                  num_scheduled_tokens=3)
            sock.send(pb.step.WorkerRequest(plan=plan).SerializeToString())
            assert not sock.poll(int(NO_REPLY_S * 1000)), f"a plan from key {secret} was processed"
            sock.close(0)

        sock = _dealer(ctx, curve_worker, str(certs / "curve" / "scheduler.key_secret"), server_public)
        reply = _hello(sock)
        assert reply is not None and reply.HasField("info")

        def execute(plan):
            sock.send(pb.step.WorkerRequest(plan=plan).SerializeToString())
            assert sock.poll(30_000), "the worker did not answer the allowed peer"
            out = pb.step.WorkerReply()
            out.ParseFromString(sock.recv())
            return out.result

        mini = MiniScheduler(execute, 16, 64, 256)
        mini.add("ok", [1, 2, 3, 4, 5], max_new=2)
        assert len(mini.run()["ok"]) == 2  # the allowed peer's plans were run, step after step
        sock.close(0)
    finally:
        ctx.destroy(linger=0)  # closes sockets an assertion left open, never blocks
