"""`python -m services.scheduler`: one engine's scheduler, serving EngineStream to gateways."""
from __future__ import annotations

import argparse
import asyncio

from services.common import procs
from services.common.grpc_server import bind, make_server
from services.common.log import setup_logging
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


def parse_args(argv: list[str] | None) -> SchedulerServiceConfig:
    p = argparse.ArgumentParser(prog="meshllm scheduler", description=__doc__)
    p.add_argument("--worker-addr", required=True, help="the worker's ZMQ address, e.g. tcp://127.0.0.1:50055")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50053)
    add_engine_args(p)
    p.add_argument("--max-waiting", type=int, default=65536, help="queued requests before refusing more")
    p.add_argument("--step-timeout-s", type=float, default=120.0, help="worker silence that counts as lost")
    p.add_argument("--served-model-name", default="")
    a = p.parse_args(argv)
    try:
        return SchedulerServiceConfig(a.worker_addr, a.host, a.port, a.max_model_len, a.max_num_seqs,
                                      a.max_num_batched_tokens, a.block_size, a.max_waiting, a.step_timeout_s,
                                      a.served_model_name, a.scheduling_policy, a.enable_prefix_caching,
                                      a.async_scheduling)
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: SchedulerServiceConfig) -> None:
    from services.scheduler.server import Engine, EngineServicer
    from services.scheduler.worker_client import WorkerClient

    log = setup_logging("scheduler")
    server, health = make_server("scheduler", ["meshllm.v1.Engine"])
    engine = Engine(cfg, WorkerClient(cfg.worker_addr, cfg.step_timeout_s), health)
    pb.engine_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
    port = bind(server, f"{cfg.host}:{cfg.port}")
    await server.start()
    print(f"scheduler listening on {cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    procs.install_stop_handlers(asyncio.get_running_loop(), stop)
    loop_task = asyncio.create_task(engine.run())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if loop_task in done and loop_task.exception() is not None:
        log.error("engine loop died: %r", loop_task.exception())
    engine.stop()
    health.set_ready(False, "stopping")
    await server.stop(grace=1.0)
    loop_task.cancel()
    engine.worker.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    asyncio.run(serve(cfg))
    return 0
