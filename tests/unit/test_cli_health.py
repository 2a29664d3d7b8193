"""`meshllm health`: exit 0 only for SERVING, over plain gRPC and over mTLS, as the container
health checks and exec probes use it."""
from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.cli.health import main as health_main
from services.common import devca


@pytest.fixture
def server():
    """A gRPC server with grpc.health.v1: liveness SERVING, `tokenizer` SERVING, `engine` NOT_SERVING."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("tokenizer", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("engine", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def test_serving_is_exit_0_and_anything_else_exit_1(server, capsys):
    assert health_main(["--addr", server]) == 0
    assert health_main(["--addr", server, "--service", "tokenizer"]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert health_main(["--addr", server, "--service", "engine"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out
    assert health_main(["--addr", server, "--service", "nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_an_unreachable_address_is_exit_1_within_the_timeout():
    from services.common.ports import free_port
    assert health_main(["--addr", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1


def test_bad_flags_are_exit_2(capsys):
    for argv in (["--addr", "nohostport"], ["--addr", "h:1", "--tls-ca-certs", "x"],
                 ["--addr", "h:1", "--tls", "--tls-certfile", "c"], ["--addr", "h:1", "--timeout", "0"]):
        with pytest.raises(SystemExit) as exc:
            health_main(argv)
        assert exc.value.code == 2, argv


def test_mtls_needs_the_client_certificate(tmp_path):
    ca = devca.make_ca()
    server_cert = devca.issue(ca, "tokenizer")
    client = devca.issue(ca, "client")
    client.write(str(tmp_path), "client")
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem())
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("tokenizer", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    creds = grpc.ssl_server_credentials([(server_cert.key_pem(), server_cert.cert_pem())],
                                        root_certificates=ca.cert_pem(), require_client_auth=True)
    port = srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    try:
        addr = f"127.0.0.1:{port}"
        tls = ["--tls", "--tls-ca-certs", str(tmp_path / "ca.pem"), "--tls-server-name", "tokenizer"]
        assert health_main(["--addr", addr, "--service", "tokenizer", *tls, "--tls-certfile",
                            str(tmp_path / "client.pem"), "--tls-keyfile", str(tmp_path / "client.key")]) == 0
        assert health_main(["--addr", addr, "--service", "tokenizer", "--timeout", "2", *tls]) == 1
        assert health_main(["--addr", addr, "--service", "tokenizer", "--timeout", "2"]) == 1  # plain
    finally:
        srv.stop(0)


def test_it_runs_as_the_meshllm_command(server):
    r = subprocess.run([sys.executable, "-m", "services.cli.main", "health", "--addr", server, "--service",
                        "tokenizer"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "tokenizer: SERVING" in r.stdout
