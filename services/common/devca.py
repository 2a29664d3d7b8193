"""A development certificate authority: one CA and a certificate per service, for local and
compose use (never for production). `scripts/dev-ca OUT_DIR` writes:

  OUT_DIR/ca.pem, ca.key                 the CA
  OUT_DIR/<service>.pem, <service>.key   one per service, valid as TLS server AND client
                                         (mTLS between services), SANs: the service name,
                                         localhost, 127.0.0.1, ::1 and any --san given
  OUT_DIR/client.pem, client.key         a client certificate for tools and tests (and the
                                         launcher's readiness checks with --internal-mtls)
  OUT_DIR/curve/...                      CURVE keys for the scheduler <-> worker ZMQ link
                                         (services/common/zmq_curve.py)

`meshllm serve --internal-mtls OUT_DIR` uses the whole set (docs/security.md).

Uses `cryptography` (pinned in requirements.txt). EC P-256 keys, SHA-256 signatures."""
from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Every internal service the launcher may start gets a certificate.
SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "embedder", "profiler", "supervisor", "kvstore")


@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    def write(self, directory: str, name: str) -> tuple[str, str]:
        cert_path, key_path = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")
        with open(cert_path, "wb") as f:
            f.write(self.cert_pem())
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.key_pem())
        return cert_path, key_path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshllm dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "meshllm dev CA", days: int = 3650) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(_name(common_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(cert, key)


def issue(ca: Issued, common_name: str, sans: list[str] | None = None, days: int = 825,
          valid_from_days: float = 0.0) -> Issued:
    """A leaf certificate for `common_name`, usable as TLS server and client.
    `valid_from_days` < 0 with a small `days` gives an already expired certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=valid_from_days) - dt.timedelta(minutes=5)
    alt: list[x509.GeneralName] = []
    for san in dict.fromkeys([common_name, "localhost", "127.0.0.1", "::1", *(sans or [])]):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            alt.append(x509.DNSName(san))
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    return Issued(cert, key)


def load_or_make_ca(out_dir: str) -> tuple[Issued, bool]:
    """The CA in `out_dir` (ca.pem + ca.key), or a new one written there. (ca, reused?)"""
    ca_cert = os.path.join(out_dir, "ca.pem")
    if os.path.exists(ca_cert):
        with open(ca_cert, "rb") as f, open(os.path.join(out_dir, "ca.key"), "rb") as k:
            return Issued(x509.load_pem_x509_certificate(f.read()),
                          serialization.load_pem_private_key(k.read(), None)), True
    ca = make_ca()
    ca.write(out_dir, "ca")
    return ca, False


def write_dev_ca(out_dir: str, services=SERVICES, sans: list[str] | None = None,
                 days: int = 825) -> Issued:
    """The whole set the module docstring lists, in `out_dir` (created 0700). Returns the CA."""
    from services.common.zmq_curve import write_keys
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    ca, _ = load_or_make_ca(out_dir)
    for name in [*services, "client"]:
        issue(ca, name, sans, days).write(out_dir, name)
    write_keys(out_dir)
    return ca


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/dev-ca", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--services", default=",".join(SERVICES), help="comma-separated service names")
    p.add_argument("--san", action="append", default=[], help="an extra DNS name or IP (repeatable)")
    p.add_argument("--days", type=int, default=825, help="validity of the service certificates")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, mode=0o700, exist_ok=True)
    _, reused = load_or_make_ca(a.out_dir)
    if reused:
        print(f"reusing the CA in {os.path.join(a.out_dir, 'ca.pem')}")
    names = [s.strip() for s in a.services.split(",") if s.strip()]
    write_dev_ca(a.out_dir, names, a.san, a.days)
    for name in [*names, "client"]:
        print(f"{name}: {os.path.join(a.out_dir, name)}.pem {os.path.join(a.out_dir, name)}.key")
    print(f"curve (scheduler <-> worker ZMQ): {os.path.join(a.out_dir, 'curve')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
