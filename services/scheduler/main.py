"""`python -m services.scheduler`: one engine's scheduler, serving EngineStream to gateways."""
from __future__ import annotations

import argparse
import asyncio

from services.common.gc_heap import freeze_startup_heap
from services.common import telemetry
from services.common import internal_tls, procs
from services.common.kv_blocks import add_kvstore_flag
from services.common.grpc_server import bind, make_server
from services.common.log import setup_logging
from services.common.metrics import add_metrics_args, start_metrics_server
from services.common import pb
from services.scheduler.config import SchedulerServiceConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared with `meshllm serve` (named as in vLLM)."""
    p.add_argument("--max-model-len", type=int, default=0, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs, or priority (lower `priority` first; preempts the lowest priority)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes (on by default)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan step N+1 while the worker runs step N (on by default)")
    p.add_argument("--speculative-config", default="",
                   help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\"|\"suffix\", "
                        "\"num_speculative_tokens\": K, ...} (docs/speculative_decoding.md); off by default")


def parse_args(argv: list[str] | None) -> SchedulerServiceConfig:
    p = argparse.ArgumentParser(prog="meshllm scheduler", description=__doc__)
    p.add_argument("--worker-addr", required=True, help="the worker's ZMQ address, e.g. tcp://127.0.0.1:50055")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50053)
    add_engine_args(p)
    p.add_argument("--max-waiting", type=int, default=65536, help="queued requests before refusing more")
    p.add_argument("--step-timeout-s", type=float, default=120.0, help="worker silence that counts as lost")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 on this port from its own threads, which heavy "
                        "traffic on the engine loop cannot delay (0: off; supervisors probe it)")
    p.add_argument("--progress-timeout-s", type=float, default=30.0,
                   help="work pending and no step completed this long: readiness NOT_SERVING")
    p.add_argument("--shutdown-grace-s", type=float, default=20.0,
                   help="on SIGTERM: readiness off, new requests refused, in-flight ones get this long")
    add_metrics_args(p, engine_id=True)
    add_kvstore_flag(p)
    p.add_argument("--kv-role", default="", choices=["", "prefill", "decode"],
                   help="prefill/decode disaggregation (docs/pd.md): the role the gateway routes by; "
                        "'' (default): both (colocated). Any engine serves hand-offs either way")
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                   help="a hand-off whose KV does not arrive: recompute the prompt here, or fail the request")
    p.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="direct hand-offs: a prefill-only request's blocks are held for the decode engine until "
                        "it has copied them or this long has passed")
    internal_tls.add_flags(p)
    p.add_argument("--zmq-curve-secret-key", default="",
                   help="CURVE on the worker link: this scheduler's secret key file (NAME.key_secret)")
    p.add_argument("--zmq-curve-server-key", default="",
                   help="CURVE on the worker link: the worker's public key file (NAME.key)")
    a = p.parse_args(argv)
    try:
        from services.common.zmq_curve import CurveClientKeys
        return SchedulerServiceConfig(a.worker_addr, a.host, a.port, a.max_model_len, a.max_num_seqs,
                                      a.max_num_batched_tokens, a.block_size, a.max_waiting, a.step_timeout_s,
                                      a.served_model_name, a.scheduling_policy, a.enable_prefix_caching,
                                      a.async_scheduling, internal_tls=internal_tls.from_args(a),
                                      zmq_curve=CurveClientKeys(a.zmq_curve_secret_key, a.zmq_curve_server_key),
                                      engine_id=a.engine_id, metrics_port=a.metrics_port,
                                      health_port=a.health_port, progress_timeout_s=a.progress_timeout_s,
                                      shutdown_grace_s=a.shutdown_grace_s, kvstore_addr=a.kvstore_addr,
                                      speculative_config=a.speculative_config, kv_role=a.kv_role,
                                      kv_load_failure_policy=a.kv_load_failure_policy, kv_lease_s=a.kv_lease_s)
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: SchedulerServiceConfig) -> None:
    from services.scheduler.server import Engine, EngineServicer
    from services.scheduler.worker_client import WorkerClient

    log = setup_logging("scheduler")
    server, health = make_server("scheduler", ["meshllm.v1.Engine"])
    engine = Engine(cfg, WorkerClient(cfg.worker_addr, cfg.step_timeout_s, cfg.zmq_curve), health)
    pb.engine_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
    port = bind(server, f"{cfg.host}:{cfg.port}", cfg.internal_tls.server_credentials())
    await server.start()
    print(f"scheduler listening on {cfg.host}:{port}", flush=True)
    metrics_port = start_metrics_server(cfg.host, cfg.metrics_port)
    if metrics_port:
        print(f"scheduler metrics on http://{cfg.host}:{metrics_port}/metrics", flush=True)
    health_server = None
    if cfg.health_port:
        from services.common.health_thread import start_health_server
        health_server, hport = start_health_server(cfg.host, cfg.health_port, ["scheduler", "meshllm.scheduler"],
                                                   engine.vitals.verdict, cfg.internal_tls.server_credentials())
        print(f"scheduler health on {cfg.host}:{hport}", flush=True)
    stop = asyncio.Event()
    # A hard exit only after the grace period the in-flight requests were promised.
    procs.install_stop_handlers(asyncio.get_running_loop(), stop, hard_exit_after_s=cfg.shutdown_grace_s + 10)
    freeze_startup_heap(log)
    engine.vitals.loop_alive = True
    loop_task = asyncio.create_task(engine.run())
    loop_task.add_done_callback(lambda _: setattr(engine.vitals, "loop_alive", False))
    mirror = asyncio.create_task(_mirror_health(engine, health))
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if loop_task in done and loop_task.exception() is not None:
        log.error("engine loop died: %r", loop_task.exception())
    mirror.cancel()
    if stop_task in done:
        await _drain(engine, cfg.shutdown_grace_s, log)
    engine.stop()
    health.set_ready(False, "stopping")
    await server.stop(grace=1.0)
    loop_task.cancel()
    if health_server is not None:
        health_server.stop(None)
    engine.worker.close()


async def _mirror_health(engine, health) -> None:
    """The main port's grpc.health.v1 follows the same verdict (progress included), at the
    pace this loop allows; the health thread's port answers even when it does not."""
    last = None
    while True:
        verdict = engine.vitals.verdict()
        if verdict != last:
            health.set_ready(*verdict)
            last = verdict
        await asyncio.sleep(0.5)


async def _drain(engine, grace_s: float, log) -> None:
    """SIGTERM: stop taking work, let in-flight requests finish for up to `grace_s`, then
    end the rest with UNAVAILABLE (the gateway reports an error, never a silent cut)."""
    import time
    engine.begin_drain()
    deadline = time.monotonic() + grace_s
    while engine.busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.busy():
        log.warning("shutdown grace (%.0fs) over: failing the requests still running", grace_s)
        engine.fail_remaining(f"the engine shut down before the request finished ({grace_s:.0f}s grace)")
        await asyncio.sleep(0.2)   # let the streams send those errors


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(telemetry.init_service("scheduler", argv))  # tracing flags + OTEL_*
    asyncio.run(serve(cfg))
    return 0
