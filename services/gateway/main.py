"""Entry point: `python -m services.gateway --port 8000 --grpc-port 50051 ...`.

One asyncio loop runs uvicorn (the OpenAI HTTP API), the grpc.aio server (public gRPC
API + health) and the clients of the tokenizer and the scheduler. With --reuse-port several
gateway processes share the HTTP and gRPC ports (the launcher's --api-server-count) and, given
PROMETHEUS_MULTIPROC_DIR, their /metrics (shared_metrics.py)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import time

import uvicorn

from services.common.gc_heap import freeze_startup_heap
from services.common import telemetry
from services.common import internal_tls, loops
from services.common.grpc_server import bind, make_server
from services.common.health_thread import start_health_server
from services.common.log import setup_logging
from services.common.procs import install_stop_handlers
from services.gateway.config import GatewayConfig
from services.gateway.clients.embedder import EmbedderClient
from services.gateway.embeddings import Embeddings
from services.gateway.clients.engine_pool import EnginePool, ReplicaSpec
from services.gateway.grpc.api import SERVICE_NAME, add_to_server
from services.gateway.http.app import create_app
from services.gateway.http.context import with_request_context
from services.gateway import flags
from services.gateway.guard import connections, security
from services.gateway.service import Gateway
from services.gateway.clients import pool_metrics
from services.gateway.clients.router import Router, RouterConfig
from services.gateway.clients.supervisor_watch import follow_supervisor
from services.gateway.clients.tokenizer_pool import TokenizerPool


def parse_args(argv: list[str] | None) -> GatewayConfig:
    d = GatewayConfig
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="gRPC port (0 = any)")
    p.add_argument("--reuse-port", action="store_true", default=d.reuse_port,
                   help="SO_REUSEPORT on the HTTP and gRPC ports: several gateway processes share "
                        "them, the kernel spreads connections (set PROMETHEUS_MULTIPROC_DIR too, "
                        "so /metrics counts every process)")
    p.add_argument("--health-port", type=int, default=d.health_port,
                   help="grpc.health.v1 answered from threads of its own, true even when request "
                        "traffic saturates the event loop (0 = off; the gRPC port serves health too)")
    p.add_argument("--tokenizer-addr", dest="tokenizer_addrs", action="append", default=None,
                   help="a tokenizer's gRPC address (repeatable: failover between them)")
    p.add_argument("--engine-addr", dest="engine_addrs", action="append", default=None,
                   help="a scheduler's gRPC address (repeatable: one per engine replica, routed)")
    p.add_argument("--supervisor-addr", default=d.supervisor_addr,
                   help="follow this supervisor's replica set (engines and tokenizers)")
    p.add_argument("--route-busy-ratio", type=float, default=d.route_busy_ratio,
                   help="prefix affinity yields when the affine replica has more than RATIO x "
                        "the least-loaded replica's outstanding tokens + SLACK")
    p.add_argument("--route-busy-slack-tokens", type=int, default=d.route_busy_slack_tokens)
    p.add_argument("--max-route-attempts", type=int, default=d.max_route_attempts,
                   help="replicas a request may be tried on when one fails before its first token")
    p.add_argument("--embedder-addr", default=d.embedder_addr,
                   help="the embedder's gRPC address (default: none, /v1/embeddings answers 404)")
    p.add_argument("--profiler-addr", default=d.profiler_addr,
                   help="the profiler service's gRPC address (default: none, /profile/* answers 404)")
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-inflight-requests", type=int, default=d.max_inflight_requests)
    p.add_argument("--tokenizer-timeout-s", type=float, default=d.tokenizer_timeout_s)
    p.add_argument("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
                   help="on SIGTERM, how long running requests may finish before being aborted")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--reasoning-parser", default=None, help="a reasoning parser (docs/parsers.md)")
    p.add_argument("--tool-call-parser", default=None, help="a tool-call parser (docs/parsers.md)")
    flags.add_flags(p, d)
    internal_tls.add_flags(p)  # our clients of the tokenizer, scheduler and embedder
    args = p.parse_args(argv)
    for name in ("tokenizer_addrs", "engine_addrs"):  # unset: the default, or the supervisor's
        if getattr(args, name) is None:
            setattr(args, name, [] if args.supervisor_addr else getattr(d(), name))
    try:
        kw = {k: v for k, v in flags.config_kwargs(args).items() if not k.startswith("internal_tls_")}
        # prometheus_client itself switched to its multiprocess files when it saw this at import.
        kw["metrics_multiproc_dir"] = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
        return GatewayConfig(**kw, internal_tls=internal_tls.from_args(args))
    except ValueError as err:
        p.error(str(err))


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # every sibling sets it too; the kernel hashes each new connection to one
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SystemExit(f"cannot bind HTTP address {host}:{port}: {err}")
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


# The event loop is taken as wedged when the readiness task has not run for this long.
LOOP_STALL_S = 10.0


class _Vitals:
    """What the health thread reads: plain attributes written by the event loop."""

    def __init__(self, ledger: connections.ConnectionLedger | None = None) -> None:
        self.ready, self.reason, self.stopping = False, "starting", False
        self.tick = time.monotonic()
        self.ledger = ledger if ledger is not None else connections.ConnectionLedger(1 << 30)

    def verdict(self) -> tuple[bool, str]:
        if self.stopping:
            return False, "stopping"
        stalled = time.monotonic() - self.tick
        if stalled > LOOP_STALL_S:
            return False, f"event loop stalled for {stalled:.0f}s"
        if self.ready and self.ledger.saturated:
            return False, self.ledger.describe()
        return self.ready, self.reason


async def _readiness(gw: Gateway, health, vitals: _Vitals, log) -> None:
    last = None
    while True:
        gw.tokenizer_ready = await gw.tokenizer.is_ready()
        saturated = vitals.ledger.saturated
        state = (gw.ready, gw.tokenizer_ready, gw.engine.connected, saturated)
        if state != last:
            reason = ("waiting for the tokenizer" if not gw.tokenizer_ready
                      else f"waiting for an engine replica ({gw.engine.describe()})"
                      if not gw.ready else vitals.ledger.describe() if saturated else "ready")
            health.set_ready(gw.ready and not saturated, reason)
            vitals.ready, vitals.reason = gw.ready, reason
            log.info("readiness: %s", reason)
            last = state
        vitals.ledger.flush_log()  # the refused / closed connections of the last 10 s, if any
        vitals.tick = time.monotonic()
        await asyncio.sleep(0.5)


async def _drain(engine: EnginePool, grace_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + grace_s
    while engine.num_inflight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def _connection_limits(config: GatewayConfig) -> connections.ConnectionLimits:
    nofile = connections.raise_nofile_limit()  # the cap is kept well under the descriptor limit
    try:
        cap = connections.connection_cap(config.max_connections, nofile)
    except ValueError as err:
        raise SystemExit(str(err))
    return connections.ConnectionLimits(
        max_connections=cap, accept_backlog=connections.accept_backlog(nofile),
        keep_alive_timeout_s=config.keep_alive_timeout_s,
        header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
        body_min_rate=config.body_min_rate, max_header_bytes=config.max_header_bytes,
        max_headers=config.max_headers)


async def serve(config: GatewayConfig) -> int:
    log = setup_logging("gateway", config.log_level)
    limits = _connection_limits(config)  # first: it may refuse to start
    creds = config.internal_tls.channel_credentials()  # None: plain internal channels
    tokenizer = TokenizerPool(config.tokenizer_addrs, config.tokenizer_timeout_s, credentials=creds)
    router = Router(RouterConfig(busy_ratio=config.route_busy_ratio,
                                 busy_slack_tokens=config.route_busy_slack_tokens))
    engine = EnginePool(tokenizer, router, max_inflight_requests=config.max_inflight_requests,
                        max_attempts=config.max_route_attempts, credentials=creds)
    engine.set_replicas([ReplicaSpec(addr, addr) for addr in config.engine_addrs])
    pool_metrics.register(engine)
    embedder = EmbedderClient(config.embedder_addr, credentials=creds) if config.embedder_addr else None
    gw = Gateway(config, tokenizer, engine,
                 embeddings=Embeddings(embedder, config.served_model_name))

    sec = security.Security(config)
    server, health = make_server("gateway", [SERVICE_NAME], sec.grpc_interceptors(), reuse_port=config.reuse_port)
    add_to_server(server, gw)
    grpc_port = bind(server, f"{config.host}:{config.grpc_port}", sec.grpc_credentials())
    await server.start()

    ledger = connections.ConnectionLedger(limits.max_connections)
    connections.install_log_guards(asyncio.get_running_loop(), ledger)
    sock = _listen(config.host, config.port, limits.accept_backlog, config.reuse_port)
    http_port = sock.getsockname()[1]
    app = create_app(gw)
    shared = None
    if config.metrics_multiproc_dir:
        from services.gateway.shared_metrics import SharedMetrics
        shared = app.state.shared_metrics = SharedMetrics(config.metrics_multiproc_dir, engine)
    elif config.reuse_port:
        log.warning("--reuse-port without PROMETHEUS_MULTIPROC_DIR: /metrics counts only the "
                    "process a scrape lands on")
    uv = _Uvicorn(uvicorn.Config(sec.wrap_http(with_request_context(app)),
                                 http=connections.protocol_class(limits, ledger),
                                 timeout_keep_alive=limits.keep_alive_timeout_s,
                                 backlog=limits.accept_backlog,
                                 log_config=None, access_log=False, lifespan="off",
                                 timeout_graceful_shutdown=5, **sec.uvicorn_kwargs()))
    engine.start()
    if embedder is not None:
        embedder.start()
    vitals = _Vitals(ledger)
    health_server = None
    if config.health_port:
        health_server, hport = start_health_server(config.host, config.health_port, ["gateway", SERVICE_NAME],
                                                   vitals.verdict, config.internal_tls.server_credentials())
        print(f"gateway health on {config.host}:{hport}", flush=True)
    freeze_startup_heap(log)
    tasks = [asyncio.create_task(uv.serve(sockets=[sock]), name="uvicorn"),
             asyncio.create_task(_readiness(gw, health, vitals, log), name="readiness")]
    if shared is not None:
        tasks.append(asyncio.create_task(shared.run(), name="shared-metrics"))
    if config.supervisor_addr:
        tasks.append(asyncio.create_task(
            follow_supervisor(config.supervisor_addr, engine, tokenizer, creds),
            name="supervisor-watch"))
    scheme = "https" if config.tls.enabled else "http"
    print(f"gateway http listening on {scheme}://{config.host}:{http_port}", flush=True)
    print(f"gateway grpc listening on {config.host}:{grpc_port}", flush=True)

    stop = asyncio.Event()
    # The hard exit comes only after the grace period promised to in-flight requests.
    install_stop_handlers(asyncio.get_running_loop(), stop, hard_exit_after_s=config.shutdown_grace_s + 10)
    sec.install_reload(asyncio.get_running_loop())
    log.info("security: %s; HTTP connections: at most %d, idle %gs, head %gs, body %d B/s per %gs, "
             "head %d headers / %d bytes", sec.describe(), limits.max_connections,
             limits.keep_alive_timeout_s, limits.header_timeout_s, limits.body_min_rate,
             limits.body_timeout_s, limits.max_headers, limits.max_header_bytes)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([stopper, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: %d requests in flight", engine.num_inflight)
    health.set_ready(False, "stopping")
    vitals.stopping = True
    uv.should_exit = True  # stop accepting connections; running requests go on
    await _drain(engine, config.shutdown_grace_s)
    engine.fail_all("the gateway is shutting down")  # streams end with an error event
    with contextlib.suppress(Exception):
        await asyncio.wait_for(tasks[0], timeout=5)
    for task in (stopper, *tasks):
        task.cancel()
    await server.stop(grace=2)
    if health_server is not None:
        health_server.stop(0)
    await engine.close()
    if embedder is not None:
        await embedder.close()
    await tokenizer.close()
    sock.close()
    if shared is not None:
        shared.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(telemetry.init_service("gateway", argv))  # tracing flags + OTEL_*
    return loops.run(serve(config))
