"""API keys, TLS / mTLS (with certificate reload) and admission control, each on its own
gateway process in front of the shared mesh's tokenizer and scheduler."""
from __future__ import annotations

import json

import signal
import socket
import ssl
import threading
import time

import grpc
import httpx
import pytest

from services.common import pb
from services.common.devca import issue, make_ca
from services.common.tls import client_ssl_context, grpc_channel_credentials
from tests.integration.gateway_proc import start_gateway

KEYS = {"flag": "flag-key-0123", "file": "file-key-4567", "env": "env-key-89ab"}
ADMIN = "admin-key-cdef0"


def completion(mesh) -> dict:
    return {"model": mesh.model_name, "prompt": "Hello", "max_tokens": 1}


# --- API keys ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(mesh, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one per line\n{KEYS['file']}\n")
    gw = start_gateway(mesh, "--api-key", KEYS["flag"], "--api-key-file", str(key_file),
                       "--admin-api-key", ADMIN, env={"MESHLLM_API_KEYS": KEYS["env"]})
    yield gw
    gw.stop()


@pytest.mark.parametrize("source", sorted(KEYS))
def test_a_key_from_each_source_is_served_over_http(keyed, mesh, source):
    r = httpx.post(f"http://127.0.0.1:{keyed.http_port}/v1/completions", json=completion(mesh),
                   headers={"authorization": f"Bearer {KEYS[source]}"}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong-key-000"},
                                     {"authorization": KEYS["flag"]},          # no scheme
                                     {"authorization": f"Basic {KEYS['flag']}"}],
                         ids=["missing", "wrong", "no-scheme", "basic"])
def test_missing_or_wrong_key_is_a_401_and_the_key_is_not_logged(keyed, mesh, headers):
    base = f"http://127.0.0.1:{keyed.http_port}"
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
        r = httpx.request(method, base + path, json=completion(mesh), headers=headers, timeout=60)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(base + "/health", timeout=10).status_code == 200   # /health stays open
    assert httpx.get(base + "/metrics", timeout=10).status_code == 200  # so does /metrics
    time.sleep(0.2)
    log = keyed.log()
    assert "auth refused" in log
    for key in (*KEYS.values(), ADMIN, "wrong-key-000"):
        assert key not in log


def test_admin_routes_need_the_admin_key(keyed):
    base = f"http://127.0.0.1:{keyed.http_port}"
    r = httpx.post(base + "/admin/anything", headers={"authorization": f"Bearer {KEYS['flag']}"})
    assert r.status_code == 401
    # The admin key passes the check (there is no such route yet: 404, not 401).
    r = httpx.post(base + "/admin/anything", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 404


def test_only_the_owner_or_an_admin_can_abort_a_request(keyed, mesh):
    """Request ids are often client-chosen and guessable: another tenant's Abort must neither
    stop the request nor tell that it exists (it answers as for an unknown id)."""
    def md(key: str):
        return (("authorization", f"Bearer {key}"),)

    long = pb.common.SamplingParams(max_tokens=1500, ignore_eos=True)
    with grpc.insecure_channel(keyed.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        for rid, killer in (("owned-by-flag-1", KEYS["flag"]), ("owned-by-flag-2", ADMIN)):
            call = stub.Generate(pb.generation.GenerateRequest(model=mesh.model_name, text="Tell me a story",
                                                               request_id=rid, sampling=long),
                                 metadata=md(KEYS["flag"]), timeout=120)
            next(call)
            other = stub.Abort(pb.generation.AbortRequest(request_ids=[rid]), metadata=md(KEYS["file"]), timeout=30)
            unknown = stub.Abort(pb.generation.AbortRequest(request_ids=["no-such-request"]),
                                 metadata=md(KEYS["file"]), timeout=30)
            assert other.aborted == unknown.aborted == 0
            assert next(call).token_ids        # still running after the foreign abort
            assert stub.Abort(pb.generation.AbortRequest(request_ids=[rid]), metadata=md(killer),
                              timeout=30).aborted == 1
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED


def test_grpc_needs_the_key_in_metadata_and_health_stays_open(keyed, mesh):
    req = pb.generation.GenerateRequest(model=mesh.model_name, text="Hello",
                                        sampling=pb.common.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(keyed.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        for md in ((), (("authorization", "Bearer wrong-key-000"),)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, metadata=md, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(pb.generation.ListModelsRequest(), metadata=md, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEYS['env']}"),),
                                 timeout=60))
        assert sum(len(r.token_ids) for r in out) == 1
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="gateway"), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


# --- TLS / mTLS -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca("test CA"), make_ca("another CA")
    paths = {"ca": ca.write(str(d), "ca")[0]}
    for name, issued in {"server": issue(ca, "gateway"), "client": issue(ca, "client"),
                         "foreign": issue(other_ca, "client"),
                         "expired": issue(ca, "client", days=1, valid_from_days=-10)}.items():
        paths[name] = issued.write(str(d), name)
    paths["ca_obj"], paths["dir"] = ca, str(d)
    return paths


@pytest.fixture(scope="module")
def mtls(mesh, pki):
    cert, key = pki["server"]
    gw = start_gateway(mesh, "--ssl-certfile", cert, "--ssl-keyfile", key,
                       "--ssl-ca-certs", pki["ca"], "--ssl-client-auth", "require")
    yield gw
    gw.stop()


def _https(pki, gw, client: str | None):
    cert, key = pki[client] if client else (None, None)
    ctx = client_ssl_context(pki["ca"], cert, key)
    return httpx.Client(base_url=f"https://127.0.0.1:{gw.http_port}", verify=ctx, timeout=60)


def test_mtls_serves_a_client_certificate_from_the_ca(mtls, mesh, pki):
    with _https(pki, mtls, "client") as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json=completion(mesh))
        assert r.status_code == 200, r.text
    creds = grpc_channel_credentials(pki["ca"], *pki["client"])
    with grpc.secure_channel(mtls.grpc_addr, creds) as ch:
        out = list(pb.generation_grpc.GenerationStub(ch).Generate(
            pb.generation.GenerateRequest(model=mesh.model_name, text="Hello",
                                          sampling=pb.common.SamplingParams(max_tokens=1)),
            timeout=60))
        assert sum(len(r.token_ids) for r in out) == 1


@pytest.mark.parametrize("client", [None, "foreign", "expired"],
                         ids=["no-cert", "other-ca", "expired"])
def test_mtls_refuses_clients_without_a_valid_certificate(mtls, pki, client):
    with _https(pki, mtls, client) as c, pytest.raises((httpx.ConnectError, httpx.ReadError,
                                                        httpx.RemoteProtocolError)):
        c.get("/health")
    creds = grpc_channel_credentials(pki["ca"], *(pki[client] if client else (None, None)))
    with grpc.secure_channel(mtls.grpc_addr, creds) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb.generation_grpc.GenerationStub(ch).ListModels(pb.generation.ListModelsRequest(),
                                                            timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plain_http_to_a_tls_listener_is_refused(mtls):
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)):
        httpx.get(f"http://127.0.0.1:{mtls.http_port}/health", timeout=10)


def _server_cert_serial(port: int, ctx: ssl.SSLContext) -> int:
    from cryptography import x509
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            return x509.load_der_x509_certificate(s.getpeercert(binary_form=True)).serial_number


def test_sighup_reloads_the_certificates_for_new_connections(mesh, pki, tmp_path):
    ca = pki["ca_obj"]
    first, second = issue(ca, "gateway"), issue(ca, "gateway")
    cert, key = first.write(str(tmp_path), "srv")
    gw = start_gateway(mesh, "--ssl-certfile", cert, "--ssl-keyfile", key)
    try:
        ctx = client_ssl_context(pki["ca"])
        assert _server_cert_serial(gw.http_port, ctx) == first.cert.serial_number
        second.write(str(tmp_path), "srv")
        gw.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "TLS certificates reloaded" not in gw.log():
            assert time.monotonic() < deadline, gw.log()[-2000:]
            time.sleep(0.1)
        assert _server_cert_serial(gw.http_port, ctx) == second.cert.serial_number
        creds = grpc_channel_credentials(pki["ca"])
        with grpc.secure_channel(gw.grpc_addr, creds) as ch:  # gRPC served with the new one
            resp = pb.generation_grpc.GenerationStub(ch).ListModels(
                pb.generation.ListModelsRequest(), timeout=10)
            assert resp.models
        assert gw.proc.poll() is None
    finally:
        gw.stop()


# --- admission control ------------------------------------------------------------------------

def test_admission_beyond_the_inflight_limit_is_a_429_and_admitted_requests_finish(mesh):
    gw = start_gateway(mesh, "--max-inflight-requests", "2", "--max-inflight-tokens", "1000")
    base = f"http://127.0.0.1:{gw.http_port}"
    long_req = {"model": mesh.model_name, "prompt": "Count:", "max_tokens": 30,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    results: list[int] = []
    started = [threading.Event(), threading.Event()]

    def run_long(i: int) -> None:
        with httpx.stream("POST", base + "/v1/completions", json=long_req, timeout=120) as resp:
            tokens = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started[i].set()
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
            results.append(tokens if resp.status_code == 200 else -resp.status_code)
            started[i].set()

    try:
        threads = [threading.Thread(target=run_long, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        r = httpx.post(base + "/v1/completions", json=completion(mesh), timeout=60)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        with grpc.insecure_channel(gw.grpc_addr) as ch, pytest.raises(grpc.RpcError) as info:
            list(pb.generation_grpc.GenerationStub(ch).Generate(pb.generation.GenerateRequest(
                model=mesh.model_name, text="Hi", sampling=pb.common.SamplingParams(max_tokens=1)),
                timeout=60))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
        for t in threads:
            t.join(120)
        assert results == [30, 30]  # both admitted requests ran to the end
        # Freed: the next request is admitted; one that alone needs too many tokens is a 400.
        assert httpx.post(base + "/v1/completions", json=completion(mesh), timeout=60).status_code == 200
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={**completion(mesh), "max_tokens": 1500})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    except BaseException:
        print(gw.log()[-6000:])
        raise
    finally:
        gw.stop()
