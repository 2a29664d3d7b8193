"""Follow the supervisor's WatchReplicas: the engine and tokenizer sets of the gateway.

Every message is the full set (the last one wins). Engines become EnginePool replicas with
the supervisor's state (only READY ones are routed to); tokenizers become the
TokenizerPool's addresses (its own health checks pick the ready ones). If the supervisor
is unreachable the last known sets stay as they are: its absence is no reason to stop
serving, and the pool's own health checks still steer traffic away from dead replicas."""
from __future__ import annotations

import asyncio
import logging

import grpc

from services.common import pb
from services.common.grpc_server import channel
from services.gateway.clients.engine_pool import EnginePool, ReplicaSpec
from services.gateway.clients.tokenizer_pool import TokenizerPool

log = logging.getLogger("meshllm.gateway.supervisor")

_PREFIX = "REPLICA_STATE_"


def state_name(state: int) -> str:
    return pb.supervisor.ReplicaState.Name(state).removeprefix(_PREFIX)


def apply_replica_set(rs: "pb.supervisor.ReplicaSet", engines: EnginePool,
                      tokenizers: TokenizerPool) -> None:
    kinds = pb.supervisor
    specs = [ReplicaSpec(r.id, r.addr, state_name(r.state), r.reason)
             for r in rs.replicas if r.kind == kinds.REPLICA_KIND_ENGINE and r.addr]
    if specs:  # a supervisor that runs no engine leaves the configured ones alone
        engines.set_replicas(specs)
    tok_addrs = [r.addr for r in rs.replicas
                 if r.kind == kinds.REPLICA_KIND_TOKENIZER and r.addr]
    if tok_addrs:  # a supervisor that runs no tokenizer leaves the configured ones alone
        tokenizers.set_addresses(tok_addrs)


async def follow_supervisor(address: str, engines: EnginePool, tokenizers: TokenizerPool,
                            credentials: grpc.ChannelCredentials | None = None) -> None:
    backoff = 0.2
    async with channel(address, credentials=credentials) as ch:
        stub = pb.supervisor_grpc.SupervisorStub(ch)
        while True:
            try:
                call = stub.WatchReplicas(pb.supervisor.WatchReplicasRequest())
                async for rs in call:
                    apply_replica_set(rs, engines, tokenizers)
                    backoff = 0.2
                    log.debug("replica set v%d: %s", rs.version, engines.describe())
                reason = "the supervisor closed WatchReplicas"
            except grpc.aio.AioRpcError as err:
                reason = f"{err.code().name}: {err.details()}"
            log.warning("supervisor %s: %s; keeping the last replica set (%s)", address, reason,
                        engines.describe())
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
