"""CURVE on the scheduler <-> worker ZMQ link (see docs/security.md for why CURVE and not
TLS-wrapped TCP).

The worker is the CURVE server: it holds its own keypair and a ZAP handler that accepts only
the client public keys found in a directory (`--zmq-curve-clients DIR`, one `*.key` file per
allowed client). The scheduler is a CURVE client: its own keypair plus the worker's public
key. A peer with no key, a key not in the directory, or the wrong server key fails the
handshake: ZMQ never hands the worker a single message from it.

Key files are pyzmq's certificate format (`zmq.auth.create_certificates`: text, a public
`NAME.key` and a `NAME.key_secret` holding both halves); `write_keys` makes the set the
launcher and `scripts/dev-ca` use:

    DIR/curve/worker.key, worker.key_secret, scheduler.key, scheduler.key_secret
    DIR/curve/clients/scheduler.key        the worker's allow list
"""
from __future__ import annotations

import glob
import logging
import os
import shutil
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("meshllm.zmq_curve")


def _check_file(flag: str, path: str) -> None:
    if path and not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a file")


def _load(path: str, flag: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path!r} is not a ZMQ certificate: {exc}") from None
    if need_secret and not secret:
        raise ValueError(f"{flag} {path!r} holds no secret key (give the .key_secret file)")
    return public, secret


@dataclass(frozen=True)
class CurveServerKeys:
    """The worker's side: its secret certificate and the directory of allowed client keys."""

    secret_key_file: str = ""
    clients_dir: str = ""

    def __post_init__(self) -> None:
        if bool(self.secret_key_file) != bool(self.clients_dir):
            raise ValueError("--zmq-curve-secret-key and --zmq-curve-clients go together")
        _check_file("--zmq-curve-secret-key", self.secret_key_file)
        if self.clients_dir:
            if not os.path.isdir(self.clients_dir):
                raise ValueError(f"--zmq-curve-clients {self.clients_dir!r} is not a directory")
            if not glob.glob(os.path.join(self.clients_dir, "*.key")):
                raise ValueError(f"--zmq-curve-clients {self.clients_dir!r} holds no *.key file")
            _load(self.secret_key_file, "--zmq-curve-secret-key", need_secret=True)

    @property
    def enabled(self) -> bool:
        return bool(self.secret_key_file)

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> ThreadAuthenticator:
        """Make `sock` (not yet bound) a CURVE server and start the ZAP handler on `ctx` that
        admits only the allowed client keys. The caller stops the returned authenticator
        before terminating `ctx`."""
        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve(domain="*", location=self.clients_dir)
        public, secret = _load(self.secret_key_file, "--zmq-curve-secret-key", need_secret=True)
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_server = True
        return auth


@dataclass(frozen=True)
class CurveClientKeys:
    """The scheduler's side: its secret certificate and the worker's public certificate."""

    secret_key_file: str = ""
    server_key_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.secret_key_file) != bool(self.server_key_file):
            raise ValueError("--zmq-curve-secret-key and --zmq-curve-server-key go together")
        _check_file("--zmq-curve-secret-key", self.secret_key_file)
        _check_file("--zmq-curve-server-key", self.server_key_file)
        if self.enabled:
            _load(self.secret_key_file, "--zmq-curve-secret-key", need_secret=True)
            _load(self.server_key_file, "--zmq-curve-server-key", need_secret=False)

    @property
    def enabled(self) -> bool:
        return bool(self.secret_key_file)

    def secure(self, sock: zmq.Socket) -> None:
        """Set the CURVE client options on `sock` before it connects."""
        public, secret = _load(self.secret_key_file, "--zmq-curve-secret-key", need_secret=True)
        server, _ = _load(self.server_key_file, "--zmq-curve-server-key", need_secret=False)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server


def write_keys(out_dir: str) -> dict[str, str]:
    """Create the worker and scheduler keypairs under `out_dir/curve` (kept if present) and
    the worker's allow list. Returns the paths the worker and scheduler flags take."""
    curve = os.path.join(out_dir, "curve")
    clients = os.path.join(curve, "clients")
    os.makedirs(curve, mode=0o700, exist_ok=True)  # secret key files appear here
    os.makedirs(clients, mode=0o700, exist_ok=True)
    for name in ("worker", "scheduler"):
        if not os.path.isfile(os.path.join(curve, f"{name}.key_secret")):
            _, secret_path = zmq.auth.create_certificates(curve, name)
            os.chmod(secret_path, 0o600)
    shutil.copyfile(os.path.join(curve, "scheduler.key"), os.path.join(clients, "scheduler.key"))
    return {"worker_secret": os.path.join(curve, "worker.key_secret"),
            "worker_public": os.path.join(curve, "worker.key"),
            "scheduler_secret": os.path.join(curve, "scheduler.key_secret"),
            "clients_dir": clients}
