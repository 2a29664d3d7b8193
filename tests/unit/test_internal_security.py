"""Internal mTLS config, the launcher's certificate set, and CURVE + ZAP on the worker's ROUTER
(real sockets in one process; the whole mesh is in tests/integration/test_security_internal.py)."""
from __future__ import annotations

import argparse
import os
import threading

import pytest
import zmq
import zmq.auth
from cryptography import x509

from services.cli.internal_security import InternalSecurity, check_dir, without_internal_tls_env
from services.common import internal_tls
from services.common.devca import write_dev_ca
from services.common.internal_tls import ENV, InternalTls
from services.common.zmq_curve import CurveClientKeys, CurveServerKeys, write_keys
from services.worker.zmq_link import LinkContext, bind_router


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    write_dev_ca(str(out), services=("tokenizer",))
    return out


def test_internal_tls_is_all_three_files_or_none(certs):
    assert not InternalTls().enabled and InternalTls().server_credentials() is None
    assert InternalTls().channel_credentials() is None
    with pytest.raises(ValueError, match="go together"):
        InternalTls(str(certs / "tokenizer.pem"), str(certs / "tokenizer.key"))
    with pytest.raises(ValueError, match="is not a file"):
        InternalTls(str(certs / "nope.pem"), str(certs / "tokenizer.key"), str(certs / "ca.pem"))
    tls = InternalTls(str(certs / "tokenizer.pem"), str(certs / "tokenizer.key"), str(certs / "ca.pem"))
    assert tls.server_credentials() is not None and tls.channel_credentials() is not None


def test_flags_default_to_the_environment_the_launcher_sets(certs):
    env = {ENV["certfile"]: str(certs / "tokenizer.pem"), ENV["keyfile"]: str(certs / "tokenizer.key"),
           ENV["ca_certs"]: str(certs / "ca.pem")}
    p = argparse.ArgumentParser()
    internal_tls.add_flags(p, environ=env)
    assert internal_tls.from_args(p.parse_args([])).certfile == env[ENV["certfile"]]
    assert not internal_tls.from_args(p.parse_args(["--internal-tls-certfile", "", "--internal-tls-keyfile", "",
                                                    "--internal-tls-ca-certs", ""])).enabled
    assert ENV["certfile"] not in without_internal_tls_env({**env, "PATH": "/bin"})


def test_auto_mode_issues_a_certificate_per_child_signed_by_its_private_ca(tmp_path):
    sec = InternalSecurity("auto", str(tmp_path))
    env = sec.child_env("profiler")  # a service dev-ca was not told about
    cert = x509.load_pem_x509_certificate(open(env[ENV["certfile"]], "rb").read())
    ca = x509.load_pem_x509_certificate(open(env[ENV["ca_certs"]], "rb").read())
    assert cert.issuer == ca.subject
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "profiler" in sans.get_values_for_type(x509.DNSName)
    assert oct(os.stat(env[ENV["keyfile"]]).st_mode & 0o777) == "0o600"
    assert "--zmq-curve-clients" in sec.child_args("worker")
    assert "--zmq-curve-server-key" in sec.child_args("scheduler")
    assert sec.child_args("tokenizer") == []


def test_a_dev_ca_dir_must_be_complete_and_cover_each_child(tmp_path, certs):
    with pytest.raises(ValueError, match="scripts/dev-ca"):
        check_dir(str(tmp_path))
    sec = InternalSecurity(str(certs), str(tmp_path))
    assert sec.child_env("tokenizer")[ENV["certfile"]].endswith("tokenizer.pem")
    with pytest.raises(RuntimeError, match="no certificate for 'embedder'"):
        sec.child_env("embedder")


def test_curve_key_files_are_checked(tmp_path):
    keys = write_keys(str(tmp_path))
    with pytest.raises(ValueError, match="go together"):
        CurveServerKeys(keys["worker_secret"], "")
    with pytest.raises(ValueError, match="no secret key"):
        CurveServerKeys(keys["worker_public"], keys["clients_dir"])  # the public half only
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.key file"):
        CurveServerKeys(keys["worker_secret"], str(empty))
    with pytest.raises(ValueError, match="is not a file"):
        CurveClientKeys(keys["scheduler_secret"], str(tmp_path / "missing.key"))


def test_curve_router_takes_messages_only_from_allowed_keys(tmp_path):
    keys = write_keys(str(tmp_path))
    _, stranger = zmq.auth.create_certificates(str(tmp_path), "stranger")
    ctx = LinkContext()
    router, addr = bind_router(ctx, "tcp://127.0.0.1:0", CurveServerKeys(keys["worker_secret"], keys["clients_dir"]))
    server_public = keys["worker_public"]

    def dealer(secret):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            CurveClientKeys(secret, server_public).secure(sock)
        sock.connect(addr)
        return sock

    for secret in (None, stranger):
        sock = dealer(secret)
        sock.send(b"let me in")
        assert not router.poll(1500), f"the ROUTER received a message from key {secret}"
        sock.close(0)
    sock = dealer(keys["scheduler_secret"])
    sock.send(b"plan")
    assert router.poll(5000)
    ident, payload = router.recv_multipart()
    assert payload == b"plan"
    router.send_multipart([ident, b"result"])
    assert sock.poll(5000) and sock.recv() == b"result"
    sock.close(0)
    router.close(0)
    done = threading.Thread(target=ctx.term, daemon=True)  # must not hang on the ZAP handler
    done.start()
    done.join(10)
    assert not done.is_alive()


def test_serve_with_an_incomplete_internal_mtls_dir_exits_2_naming_what_is_missing(smollm2_dir, tmp_path, capsys):
    from services.cli.main import main
    assert main(["serve", str(smollm2_dir), "--internal-mtls", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ca.pem" in err and "scripts/dev-ca" in err
