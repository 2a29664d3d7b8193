"""Entry point: `python -m services.gateway --port 8000 --grpc-port 50051 ...`.

One asyncio loop runs uvicorn (the OpenAI HTTP API), the grpc.aio server (public gRPC
API + health) and the clients of the tokenizer and the scheduler."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket

import uvicorn

from services.common import loops
from services.common.grpc_server import bind, make_server
from services.common.log import setup_logging
from services.common.procs import install_stop_handlers
from services.gateway.config import GatewayConfig
from services.gateway.embedder_client import EmbedderClient
from services.gateway.embeddings import Embeddings
from services.gateway.engine_client import EngineClient
from services.gateway.grpc_api import SERVICE_NAME, add_to_server
from services.gateway.http_app import create_app, with_request_context
from services.gateway import security
from services.gateway.service import Gateway
from services.gateway.tokenizer_client import TokenizerClient


def parse_args(argv: list[str] | None) -> GatewayConfig:
    d = GatewayConfig
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="gRPC port (0 = any)")
    p.add_argument("--tokenizer-addr", default=d.tokenizer_addr)
    p.add_argument("--engine-addr", default=d.engine_addr, help="the scheduler's gRPC address")
    p.add_argument("--embedder-addr", default=d.embedder_addr,
                   help="the embedder's gRPC address (default: none, /v1/embeddings answers 404)")
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-inflight-requests", type=int, default=d.max_inflight_requests)
    p.add_argument("--tokenizer-timeout-s", type=float, default=d.tokenizer_timeout_s)
    p.add_argument("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
                   help="on SIGTERM, how long running requests may finish before being aborted")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--reasoning-parser", default=None, help="deepseek_r1 | qwen3")
    p.add_argument("--tool-call-parser", default=None, help="hermes | llama3_json")
    security.add_flags(p, d)
    args = p.parse_args(argv)
    try:
        return GatewayConfig(**security.config_kwargs(args))
    except ValueError as err:
        p.error(str(err))


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SystemExit(f"cannot bind HTTP address {host}:{port}: {err}")
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _readiness(gw: Gateway, health, log) -> None:
    last = None
    while True:
        gw.tokenizer_ready = await gw.tokenizer.is_ready()
        state = (gw.ready, gw.tokenizer_ready, gw.engine.connected)
        if state != last:
            reason = ("ready" if gw.ready else "waiting for the tokenizer" if not gw.tokenizer_ready
                      else "waiting for the engine")
            health.set_ready(gw.ready, reason)
            log.info("readiness: %s", reason)
            last = state
        await asyncio.sleep(0.5)


async def _drain(engine: EngineClient, grace_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + grace_s
    while engine.num_inflight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


async def serve(config: GatewayConfig) -> int:
    log = setup_logging("gateway", config.log_level)
    tokenizer = TokenizerClient(config.tokenizer_addr, config.tokenizer_timeout_s)
    engine = EngineClient(config.engine_addr, tokenizer, config.max_inflight_requests)
    embedder = EmbedderClient(config.embedder_addr) if config.embedder_addr else None
    gw = Gateway(config, tokenizer, engine,
                 embeddings=Embeddings(embedder, config.served_model_name))

    sec = security.Security(config)
    server, health = make_server("gateway", [SERVICE_NAME], sec.grpc_interceptors())
    add_to_server(server, gw)
    grpc_port = bind(server, f"{config.host}:{config.grpc_port}", sec.grpc_credentials())
    await server.start()

    sock = _listen(config.host, config.port)
    http_port = sock.getsockname()[1]
    uv = _Uvicorn(uvicorn.Config(sec.wrap_http(with_request_context(create_app(gw))),
                                 log_config=None, access_log=False, lifespan="off",
                                 timeout_graceful_shutdown=5, **sec.uvicorn_kwargs()))
    engine.start()
    if embedder is not None:
        embedder.start()
    tasks = [asyncio.create_task(uv.serve(sockets=[sock]), name="uvicorn"),
             asyncio.create_task(_readiness(gw, health, log), name="readiness")]
    scheme = "https" if config.tls.enabled else "http"
    print(f"gateway http listening on {scheme}://{config.host}:{http_port}", flush=True)
    print(f"gateway grpc listening on {config.host}:{grpc_port}", flush=True)

    stop = asyncio.Event()
    install_stop_handlers(asyncio.get_running_loop(), stop)
    sec.install_reload(asyncio.get_running_loop())
    log.info("security: %s", sec.describe())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([stopper, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: %d requests in flight", engine.num_inflight)
    health.set_ready(False, "stopping")
    uv.should_exit = True  # stop accepting connections; running requests go on
    await _drain(engine, config.shutdown_grace_s)
    engine.fail_all("the gateway is shutting down")  # streams end with an error event
    with contextlib.suppress(Exception):
        await asyncio.wait_for(tasks[0], timeout=5)
    for task in (stopper, *tasks):
        task.cancel()
    await server.stop(grace=2)
    await engine.close()
    if embedder is not None:
        await embedder.close()
    await tokenizer.close()
    sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    return loops.run(serve(config))
