"""`meshllm serve --internal-mtls DIR|auto`: the certificates and CURVE keys a local mesh uses
on its internal hops (docs/security.md).

- DIR: a directory written by `scripts/dev-ca DIR` (ca.pem, <service>.pem/.key, client.pem/.key,
  curve/...). Each child gets its own certificate; the launcher's readiness checks use client.pem.
- auto: a fresh CA and keys generated into the mesh's private (0700) temporary directory,
  removed when the mesh stops. Certificates are issued per child as it is spawned, so a
  service added later needs no change here.

Every child gets MESHLLM_INTERNAL_TLS_{CERTFILE,KEYFILE,CA_CERTS} (services/common/internal_tls.py);
the worker and scheduler also get the CURVE flags for their ZMQ link."""
from __future__ import annotations

import os

import grpc

from services.common.internal_tls import ENV, InternalTls

REQUIRED_FILES = ("ca.pem", "client.pem", "client.key", "curve/worker.key", "curve/worker.key_secret",
                  "curve/scheduler.key_secret", "curve/clients")


def check_dir(path: str) -> None:
    """ValueError unless `path` holds what `scripts/dev-ca` writes (a clear message, at startup)."""
    if not os.path.isdir(path):
        raise ValueError(f"--internal-mtls {path!r} is not a directory (make one with scripts/dev-ca {path})")
    missing = [f for f in REQUIRED_FILES if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise ValueError(f"--internal-mtls {path!r} lacks {', '.join(missing)}: "
                         f"run scripts/dev-ca {path} (it keeps an existing CA)")


def without_internal_tls_env(env: dict[str, str]) -> dict[str, str]:
    """A plain mesh: drop inherited MESHLLM_INTERNAL_TLS_* so no child turns mTLS on alone
    (the launcher's plain readiness checks would then be refused)."""
    return {k: v for k, v in env.items() if k not in ENV.values()}


class InternalSecurity:
    def __init__(self, spec: str, private_dir: str) -> None:
        self._ca = None
        if spec == "auto":
            from services.common.devca import write_dev_ca
            self.dir = os.path.join(private_dir, "internal-tls")
            self._ca = write_dev_ca(self.dir, services=())  # CA, client cert, CURVE keys
        else:
            check_dir(spec)
            self.dir = os.path.abspath(spec)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def identity(self, name: str) -> InternalTls:
        """The certificate `name` serves and presents; issued now in auto mode."""
        cert, key = self._path(f"{name}.pem"), self._path(f"{name}.key")
        if not os.path.isfile(cert) or not os.path.isfile(key):
            if self._ca is None:
                raise RuntimeError(f"--internal-mtls {self.dir}: no certificate for {name!r} "
                                   f"(run scripts/dev-ca {self.dir} --services ...,{name})")
            from services.common.devca import issue
            issue(self._ca, name).write(self.dir, name)
        return InternalTls(cert, key, self._path("ca.pem"))

    def child_env(self, name: str) -> dict[str, str]:
        tls = self.identity(name)
        return {ENV["certfile"]: tls.certfile, ENV["keyfile"]: tls.keyfile, ENV["ca_certs"]: tls.ca_certs}

    def client_credentials(self) -> grpc.ChannelCredentials:
        """For the launcher's own readiness checks."""
        return InternalTls(self._path("client.pem"), self._path("client.key"),
                           self._path("ca.pem")).channel_credentials()

    def child_args(self, name: str) -> list[str]:
        """CURVE flags for the two ends of the ZMQ link; nothing for the other services."""
        if name == "worker":
            return ["--zmq-curve-secret-key", self._path("curve/worker.key_secret"),
                    "--zmq-curve-clients", self._path("curve/clients")]
        if name == "scheduler":
            return ["--zmq-curve-secret-key", self._path("curve/scheduler.key_secret"),
                    "--zmq-curve-server-key", self._path("curve/worker.key")]
        return []
