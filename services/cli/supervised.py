"""The launcher's side of the supervisor: the spec it writes (what to run) and the wait for
every replica to be READY. The supervisor (services/supervisor) starts, health-checks and
restarts the services; the launcher only starts the supervisor."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import grpc

from services.common import pb


def process(module: str, args: list[str], env: dict[str, str] | None = None, health_addr: str = "",
            health_service: str = "", probe: int = 0) -> "pb.supervisor.ProcessSpec":
    return pb.supervisor.ProcessSpec(module=module, args=args, env=env or {}, health_addr=health_addr,
                                     health_service=health_service, probe=probe)


def write_spec(path: str, replicas: list["pb.supervisor.ReplicaSpec"]) -> None:
    from google.protobuf import json_format
    spec = pb.supervisor.SupervisorSpec(replicas=replicas)
    # 0600: a child's environment may carry a key (the profiler's admin key for the gateway).
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        f.write(json_format.MessageToJson(spec))


def state_name(state: int) -> str:
    return pb.supervisor.ReplicaState.Name(state).removeprefix("REPLICA_STATE_")


async def wait_replicas_ready(addr: str, credentials: grpc.ChannelCredentials | None, timeout_s: float,
                              check_alive: Callable[[], None]) -> "pb.supervisor.ReplicaSet":
    """Until every replica is READY. A DEAD one (the supervisor gave up on it) fails at once
    with the supervisor's reason; so does the supervisor exiting (check_alive raises)."""
    from services.common.grpc_server import channel
    deadline = time.monotonic() + timeout_s
    last = None
    async with channel(addr, credentials=credentials) as ch:
        stub = pb.supervisor_grpc.SupervisorStub(ch)
        while True:
            check_alive()
            try:
                last = await stub.ListReplicas(pb.supervisor.ListReplicasRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                last = None   # the supervisor is still starting
            if last is not None and last.replicas:
                dead = [r for r in last.replicas if r.state == pb.supervisor.REPLICA_STATE_DEAD]
                if dead:
                    raise RuntimeError("; ".join(f"{r.id} could not be started: {r.reason}" for r in dead))
                if all(r.state == pb.supervisor.REPLICA_STATE_READY for r in last.replicas):
                    return last
            if time.monotonic() > deadline:
                waiting = ", ".join(f"{r.id} {state_name(r.state)} {r.reason}".strip()
                                    for r in (last.replicas if last else [])
                                    if r.state != pb.supervisor.REPLICA_STATE_READY)
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {waiting or 'the supervisor'}")
            await asyncio.sleep(0.2)
