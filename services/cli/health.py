"""`meshllm health --addr HOST:PORT [--service NAME] [--tls ...]`: one grpc.health.v1 Check.

Exit 0 when the answer is SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable,
timeout), 2 for bad flags. Container HEALTHCHECKs and exec probes run it, so it imports only
grpc and the health stubs and prints one short line."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthCheckConfig:
    addr: str
    service: str = ""            # "" = liveness (the process answers); a name = its readiness
    timeout_s: float = 3.0
    tls: bool = False
    ca_certs: str = ""           # PEM bundle to verify the server with ("" = system roots)
    certfile: str = ""           # client certificate (mTLS), with keyfile
    keyfile: str = ""
    server_name: str = ""        # override the name checked in the server certificate

    def __post_init__(self) -> None:
        host, sep, port = self.addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--addr must be HOST:PORT, got {self.addr!r}")
        if not self.timeout_s > 0:
            raise ValueError("--timeout must be > 0")
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("--tls-certfile and --tls-keyfile go together")
        if (self.ca_certs or self.certfile or self.server_name) and not self.tls:
            raise ValueError("--tls-* options need --tls")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check(cfg: HealthCheckConfig) -> tuple[bool, str]:
    """(serving?, what was seen)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if cfg.tls:
        creds = grpc.ssl_channel_credentials(
            _read(cfg.ca_certs) if cfg.ca_certs else None,
            _read(cfg.keyfile) if cfg.keyfile else None,
            _read(cfg.certfile) if cfg.certfile else None)
        options = [("grpc.ssl_target_name_override", cfg.server_name)] if cfg.server_name else []
        channel = grpc.secure_channel(cfg.addr, creds, options=options)
    else:
        channel = grpc.insecure_channel(cfg.addr)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=cfg.service), timeout=cfg.timeout_s)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def parse_args(argv: list[str] | None) -> HealthCheckConfig:
    """Flags -> validated config (argparse exits with 2 on bad flags)."""
    p = argparse.ArgumentParser(prog="meshllm health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", required=True, help="the service's gRPC address, HOST:PORT")
    p.add_argument("--service", default="",
                   help="readiness of this service name (e.g. tokenizer); default: liveness")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--tls-ca-certs", default="", help="CA bundle that signed the server's certificate")
    p.add_argument("--tls-certfile", default="", help="client certificate, for servers that require mTLS")
    p.add_argument("--tls-keyfile", default="", help="the client certificate's key")
    p.add_argument("--tls-server-name", default="", help="name expected in the server certificate")
    a = p.parse_args(argv)
    try:
        return HealthCheckConfig(addr=a.addr, service=a.service, timeout_s=a.timeout, tls=a.tls,
                                 ca_certs=a.tls_ca_certs, certfile=a.tls_certfile, keyfile=a.tls_keyfile,
                                 server_name=a.tls_server_name)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        ok, seen = check(cfg)
    except OSError as exc:  # unreadable certificate files
        print(f"meshllm health: {exc}", file=sys.stderr)
        return 1
    print(f"{cfg.addr} {cfg.service or '(liveness)'}: {seen}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
