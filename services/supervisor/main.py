"""`python -m services.supervisor --spec SPEC.json [--port P] ...`: start every replica the
spec names, keep them running, and serve meshllm.v1.Supervisor + grpc.health.v1."""
from __future__ import annotations

import argparse
import asyncio

from services.common import internal_tls
from services.common.log import setup_logging
from services.supervisor.config import SupervisorConfig, load_spec
from services.supervisor.state import Policy


def parse_args(argv: list[str] | None) -> SupervisorConfig:
    d, pd = SupervisorConfig.__dataclass_fields__, Policy.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m services.supervisor", description=__doc__)
    p.add_argument("--spec", required=True,
                   help="what to run: a meshllm.v1.SupervisorSpec in protobuf's JSON form "
                        "(meshllm serve writes one)")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="gRPC port (0: any free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--health-interval-s", type=float, default=d["health_interval_s"].default,
                   help="seconds between health rounds")
    p.add_argument("--health-timeout-s", type=float, default=d["health_timeout_s"].default,
                   help="a probe unanswered this long counts as unreachable")
    p.add_argument("--stop-grace-s", type=float, default=d["stop_grace_s"].default,
                   help="on shutdown, SIGKILL a child this long after SIGTERM")
    p.add_argument("--startup-timeout-s", type=float, default=pd["startup_timeout_s"].default,
                   help="a replica not ready this long after starting is restarted")
    p.add_argument("--unhealthy-after-s", type=float, default=pd["unhealthy_after_s"].default,
                   help="a ready replica whose probes go unanswered this long (hung) is restarted")
    p.add_argument("--unready-after-s", type=float, default=pd["unready_after_s"].default,
                   help="an engine NOT_SERVING this long (worker lost, no progress) is restarted")
    p.add_argument("--backoff-initial-s", type=float, default=pd["backoff_initial_s"].default)
    p.add_argument("--backoff-max-s", type=float, default=pd["backoff_max_s"].default)
    p.add_argument("--max-restarts", type=int, default=pd["max_restarts"].default,
                   help="restarts within --restart-window-s before a replica is left DEAD")
    p.add_argument("--restart-window-s", type=float, default=pd["restart_window_s"].default)
    p.add_argument("--log-level", default=None)
    internal_tls.add_flags(p)
    a = p.parse_args(argv)
    setup_logging("supervisor", a.log_level)
    try:
        policy = Policy(startup_timeout_s=a.startup_timeout_s, unhealthy_after_s=a.unhealthy_after_s,
                        unready_after_s=a.unready_after_s, backoff_initial_s=a.backoff_initial_s,
                        backoff_max_s=a.backoff_max_s, max_restarts=a.max_restarts,
                        restart_window_s=a.restart_window_s)
        return SupervisorConfig(spec=load_spec(a.spec), host=a.host, port=a.port, metrics_port=a.metrics_port,
                                health_interval_s=a.health_interval_s, health_timeout_s=a.health_timeout_s,
                                stop_grace_s=a.stop_grace_s, policy=policy,
                                internal_tls=internal_tls.from_args(a))
    except ValueError as exc:
        p.error(str(exc))


async def serve(cfg: SupervisorConfig) -> int:
    import logging

    from services.common import pb
    from services.common.grpc_server import bind, make_server
    from services.common.metrics import start_metrics_server
    from services.common.procs import install_stop_handlers
    from services.supervisor.runner import Supervisor
    from services.supervisor.server import SupervisorServicer

    log = logging.getLogger("meshllm.supervisor")
    sup = Supervisor(cfg)
    server, health = make_server("supervisor", ["meshllm.v1.Supervisor"])
    pb.supervisor_grpc.add_SupervisorServicer_to_server(SupervisorServicer(sup), server)
    port = bind(server, f"{cfg.host}:{cfg.port}", cfg.internal_tls.server_credentials())
    metrics_port = start_metrics_server(cfg.host, cfg.metrics_port)
    await server.start()
    stop = asyncio.Event()
    # Stopping in two stages (the gateway, then the rest) may take the grace twice; a hard
    # exit before that would cut in-flight requests (the children then get SIGTERM from
    # the kernel, PR_SET_PDEATHSIG, and stop on their own).
    install_stop_handlers(asyncio.get_running_loop(), stop, hard_exit_after_s=2 * cfg.stop_grace_s + 10)
    health.set_ready(True)
    print(f"supervisor listening on {cfg.host}:{port}"
          + (f" metrics=:{metrics_port}" if metrics_port else ""), flush=True)
    loop_task = asyncio.create_task(sup.run())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if loop_task in done and loop_task.exception() is not None:
        log.error("supervisor loop died: %r", loop_task.exception())
        rc = 1
    health.set_ready(False, "stopping")
    loop_task.cancel()
    await sup.stop_all()
    await server.stop(grace=0.5)
    log.info("supervisor stopped")
    return rc


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(serve(parse_args(argv)))
