"""TLS / mTLS for HTTP (uvicorn) and gRPC listeners, with certificates reloadable without a
restart: `reload()` (called on SIGHUP) re-reads the files; new connections use them,
connections already open keep theirs.

- HTTP: one `ssl.SSLContext` we own and hand to uvicorn; reload = `load_cert_chain` (and
  `load_verify_locations` for the CA bundle) on that same context.
- gRPC: `grpc.dynamic_ssl_server_credentials`, whose fetcher hands gRPC a new certificate
  configuration after each reload (gRPC calls it on new handshakes).

client_auth: `none` (server TLS only), `optional` (a client certificate is verified if
sent), `require` (mTLS: no valid client certificate signed by `ca_certs`, no connection).
"""
from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass

import grpc

log = logging.getLogger("meshllm.tls")

CLIENT_AUTH = ("none", "optional", "require")


@dataclass
class TlsConfig:
    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    client_auth: str = "none"

    def __post_init__(self) -> None:
        if self.client_auth not in CLIENT_AUTH:
            raise ValueError(f"--ssl-client-auth must be one of {CLIENT_AUTH}, "
                             f"got {self.client_auth!r}")
        if bool(self.keyfile) != bool(self.certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.client_auth != "none" and not self.ca_certs:
            raise ValueError("--ssl-client-auth optional|require needs --ssl-ca-certs")
        if self.client_auth != "none" and not self.enabled:
            raise ValueError("--ssl-client-auth needs --ssl-keyfile and --ssl-certfile")
        for name in ("keyfile", "certfile", "ca_certs"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"--ssl-{name.replace('_', '-')} {path!r} is not a file")

    @property
    def enabled(self) -> bool:
        return bool(self.certfile)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        with open(self.keyfile, "rb") as f:
            key = f.read()
        with open(self.certfile, "rb") as f:
            cert = f.read()
        ca = None
        if self.ca_certs:
            with open(self.ca_certs, "rb") as f:
                ca = f.read()
        return key, cert, ca


class ServerTls:
    """The listeners' TLS state for one service; `reload()` swaps in the files' contents."""

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._grpc_pending: "grpc.ServerCertificateConfiguration | None" = None
        self.ssl_context = self._new_context()
        self.generation = 0

    def _new_context(self) -> ssl.SSLContext:
        c = self.config
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(c.certfile, c.keyfile)
        if c.ca_certs:
            ctx.load_verify_locations(c.ca_certs)
        ctx.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                           "require": ssl.CERT_REQUIRED}[c.client_auth]
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def reload(self) -> bool:
        """Re-read key, certificate and CA. False (and the old ones kept) if they are bad."""
        c = self.config
        try:
            self._new_context()  # validate the files (key matches certificate) first
            self.ssl_context.load_cert_chain(c.certfile, c.keyfile)
            if c.ca_certs:
                self.ssl_context.load_verify_locations(c.ca_certs)
            key, cert, ca = c._read()
        except (OSError, ssl.SSLError) as err:
            log.error("TLS reload failed, keeping the current certificates: %s", err)
            return False
        with self._lock:
            self._grpc_pending = grpc.ssl_server_certificate_configuration([(key, cert)], ca)
            self.generation += 1
        log.info("TLS certificates reloaded (generation %d)", self.generation)
        return True

    def _fetch_grpc(self):
        # Called by gRPC core on new handshakes: None = keep the current configuration.
        with self._lock:
            pending, self._grpc_pending = self._grpc_pending, None
        return pending

    def grpc_credentials(self) -> grpc.ServerCredentials:
        key, cert, ca = self.config._read()
        initial = grpc.ssl_server_certificate_configuration([(key, cert)], ca)
        # gRPC has no "optional" mode: without require it asks for and verifies a client
        # certificate when one is sent (if a CA is configured), like ssl.CERT_OPTIONAL.
        return grpc.dynamic_ssl_server_credentials(
            initial, self._fetch_grpc,
            require_client_authentication=self.config.client_auth == "require")


def client_ssl_context(ca_certs: str | None, certfile: str | None = None,
                       keyfile: str | None = None) -> ssl.SSLContext:
    """For clients of our listeners (tests, tools): verify the server, present a cert."""
    ctx = ssl.create_default_context(cafile=ca_certs)
    if certfile:
        ctx.load_cert_chain(certfile, keyfile)
    return ctx


def grpc_channel_credentials(ca_certs: str | None, certfile: str | None = None,
                             keyfile: str | None = None) -> grpc.ChannelCredentials:
    def read(path):
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(read(ca_certs), read(keyfile), read(certfile))
