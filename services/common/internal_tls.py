"""mTLS on the internal gRPC hops (gateway -> tokenizer / scheduler / embedder, the launcher's
readiness checks, the worker's health port, and any service added later).

One identity per process: a certificate + key (signed by the mesh CA) that the process
presents both as a server (on its gRPC port) and as a client (on its channels to the other
services), and the CA bundle it trusts. With it every internal server *requires* a client
certificate from that CA, and every internal client verifies the server's.

A service opts in with three lines:

    internal_tls.add_flags(parser)                        # --internal-tls-* (+ env defaults)
    tls = internal_tls.from_args(args)                    # validated InternalTls
    bind(server, addr, tls.server_credentials())          # None when off: plain port
    channel(addr, credentials=tls.channel_credentials())  # None when off: plain channel

The flags default to the MESHLLM_INTERNAL_TLS_{CERTFILE,KEYFILE,CA_CERTS} environment
variables, which `meshllm serve --internal-mtls` sets for every child it starts, so a new
service picks the mesh identity up without the launcher knowing its flags."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

ENV = {"certfile": "MESHLLM_INTERNAL_TLS_CERTFILE", "keyfile": "MESHLLM_INTERNAL_TLS_KEYFILE",
       "ca_certs": "MESHLLM_INTERNAL_TLS_CA_CERTS"}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class InternalTls:
    certfile: str = ""
    keyfile: str = ""
    ca_certs: str = ""

    def __post_init__(self) -> None:
        given = [bool(self.certfile), bool(self.keyfile), bool(self.ca_certs)]
        if any(given) and not all(given):
            raise ValueError("--internal-tls-certfile, --internal-tls-keyfile and "
                             "--internal-tls-ca-certs go together (all three or none)")
        for name in ("certfile", "keyfile", "ca_certs"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"--internal-tls-{name.replace('_', '-')} {path!r} is not a file")

    @property
    def enabled(self) -> bool:
        return bool(self.certfile)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """mTLS for an internal gRPC port (a client certificate from our CA is required);
        None when internal TLS is off (the caller binds a plain port)."""
        if not self.enabled:
            return None
        return grpc.ssl_server_credentials([(_read(self.keyfile), _read(self.certfile))],
                                           root_certificates=_read(self.ca_certs),
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """For a channel to another internal service: verify it against our CA and present
        our certificate. None when off (plain channel)."""
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(_read(self.ca_certs), _read(self.keyfile),
                                            _read(self.certfile))


def add_flags(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    g = p.add_argument_group("internal mTLS (gRPC between meshllm services)")
    g.add_argument("--internal-tls-certfile", default=env.get(ENV["certfile"], ""),
                   help=f"this service's certificate, served and presented to peers (env {ENV['certfile']})")
    g.add_argument("--internal-tls-keyfile", default=env.get(ENV["keyfile"], ""),
                   help=f"its private key (env {ENV['keyfile']})")
    g.add_argument("--internal-tls-ca-certs", default=env.get(ENV["ca_certs"], ""),
                   help=f"the CA bundle peers must be signed by (env {ENV['ca_certs']})")


def from_args(a: argparse.Namespace) -> InternalTls:
    return InternalTls(a.internal_tls_certfile, a.internal_tls_keyfile, a.internal_tls_ca_certs)
