"""The gateway's engine replicas: one EngineClient per scheduler, routed by router.Router.

A replica takes new requests only while it is *routable*: its EngineStream is open, its
grpc.health.v1 readiness is SERVING (polled here), and, when a supervisor publishes the
set, the supervisor says READY (DRAINING, STARTING, RESTARTING and DEAD take nothing new).
Requests already on a replica that stops being routable finish there.

A request whose replica fails it before its first token (the EngineStream broke, or the
scheduler lost its worker and answered UNAVAILABLE) is submitted again, on the same
handle, to another routable replica, at most `max_attempts` replicas in all; after its
first token it fails with UNAVAILABLE (the client sees an error event, never a hang)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.common import pb, telemetry
from services.gateway.clients.engine_stream import EngineClient
from services.gateway.clients.request_handle import RequestHandle
from services.gateway.errors import ApiError
from services.gateway.clients.router import ReplicaLoad, Router

log = logging.getLogger("meshllm.gateway.pool")

READY = "READY"
RESET_TIMEOUT_S = 15.0   # the scheduler waits up to 10 s for a step boundary


@dataclass(frozen=True)
class ReplicaSpec:
    replica_id: str
    address: str
    state: str = READY        # the supervisor's state name (STARTING, READY, DRAINING, ...)
    reason: str = ""


class Replica:
    def __init__(self, spec: ReplicaSpec, client: EngineClient) -> None:
        self.spec, self.client = spec, client
        self.serving = False                  # the scheduler's readiness, last poll
        self.was_routable = False

    @property
    def routable(self) -> bool:
        c = self.client
        return self.spec.state == READY and self.serving and c.connected and c.info is not None

    def describe(self) -> str:
        why = (self.spec.state if self.spec.state != READY else
               "not connected" if not self.client.connected else
               "not ready" if not self.serving else "ready")
        return f"{self.spec.replica_id}={why}"

    async def poll_health(self, timeout_s: float) -> bool:
        self.serving = await self.client.check_readiness(timeout_s)
        return self.serving


class EnginePool:
    def __init__(self, tokenizer, router: Router, *, max_inflight_requests: int = 4096,
                 max_attempts: int = 3, health_interval_s: float = 0.5,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.tokenizer, self.router = tokenizer, router
        self._credentials = credentials             # internal mTLS, None: plain channels
        self.max_inflight_requests = max_inflight_requests
        self.max_attempts = max_attempts
        self.health_interval_s = health_interval_s
        self._replicas: dict[str, Replica] = {}   # address -> replica (addresses are stable)
        self._started = False
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.retries = 0                            # requests moved before their first token
        self.routed: dict[str, int] = {}            # route reason -> count
        self.handoffs: dict[str, int] = {}          # prefill -> decode hand-offs, by outcome (docs/pd.md)

    # --- membership ----------------------------------------------------------------------

    def set_replicas(self, specs: Sequence[ReplicaSpec]) -> None:
        wanted = {s.address: s for s in specs}
        for addr in [a for a in self._replicas if a not in wanted]:
            replica = self._replicas.pop(addr)
            self.router.forget_replica(replica.spec.replica_id)
            log.warning("engine replica %s (%s) left the set", replica.spec.replica_id, addr)
            self._spawn(replica.client.close(f"engine replica {replica.spec.replica_id} "
                                             "left the replica set"))
        for addr, spec in wanted.items():
            replica = self._replicas.get(addr)
            if replica is None:
                client = EngineClient(addr, self.tokenizer, self.max_inflight_requests,
                                      replica_id=spec.replica_id,
                                      credentials=self._credentials)
                client.on_lost_before_first_token = self._retry
                client.on_handoff = self._continue_on_decode
                replica = self._replicas[addr] = Replica(spec, client)
                if self._started:
                    client.start()
                log.info("engine replica %s at %s joined (%s)", spec.replica_id, addr, spec.state)
                continue
            if replica.spec != spec:
                if spec.state != replica.spec.state:
                    log.info("engine replica %s: %s -> %s %s", spec.replica_id,
                             replica.spec.state, spec.state, spec.reason)
                if spec.state in ("RESTARTING", "DEAD", "STARTING"):
                    self.router.forget_replica(spec.replica_id)  # its KV cache is gone
                replica.spec = spec
                replica.client.replica_id = spec.replica_id

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def describe(self) -> str:
        return ", ".join(r.describe() for r in self._replicas.values()) or "none configured"

    # --- what the Gateway reads ----------------------------------------------------------

    @property
    def connected(self) -> bool:
        """At least one replica takes new requests."""
        return any(r.routable for r in self._replicas.values())

    @property
    def info(self) -> "pb.engine.EngineInfo | None":
        """The engine's limits (every replica serves the same model with the same flags)."""
        infos = [r.client.info for r in self._replicas.values() if r.client.info is not None]
        routable = [r.client.info for r in self._replicas.values() if r.routable]
        return (routable or infos or [None])[0]

    @property
    def num_inflight(self) -> int:
        return sum(r.client.num_inflight for r in self._replicas.values())

    # --- requests ------------------------------------------------------------------------

    def _routable_loads(self, role: str | None = None) -> tuple[dict[str, Replica], list[ReplicaLoad]]:
        """Routable replicas (with `role`: only those whose engine has that kv_role)."""
        by_id = {r.spec.replica_id: r for r in self._replicas.values()
                 if r.routable and (role is None or r.client.info.kv_role == role)}
        return by_id, [ReplicaLoad(rid, r.client.outstanding_tokens) for rid, r in by_id.items()]

    def _disaggregated(self) -> bool:
        """Prefill/decode disaggregation (docs/pd.md): a prefill and a decode engine are routable."""
        roles = {r.client.info.kv_role for r in self._replicas.values() if r.routable}
        return "prefill" in roles and "decode" in roles

    def submit(self, request_id: str, prompt_ids: Sequence[int],
               sampling: "pb.common.SamplingParams", *, cache_salt: str = "",
               priority: int = 0) -> RequestHandle:
        tried: list[str] = []
        # Disaggregated: the prompt goes to a prefill engine (prefix-aware, least loaded) as
        # prefill-only; its first token streams from there and the rest from a decode engine.
        role, handoff = (("prefill", pb.engine.KvHandoff(prefill_only=True))
                         if self._disaggregated() and sampling.max_tokens > 1 else (None, None))
        while True:
            by_id, loads = self._routable_loads(role)
            decision = self.router.choose(loads, prompt_ids, exclude=tried)
            if decision is None:
                raise ApiError("unavailable", "no engine replica is ready to take requests "
                               f"({self.describe()}); try again shortly")
            try:
                handle = by_id[decision.replica_id].client.submit(
                    request_id, prompt_ids, sampling, cache_salt=cache_salt, priority=priority,
                    kv_handoff=handoff)
            except ApiError as err:
                if err.kind != "unavailable":
                    raise
                tried.append(decision.replica_id)
                continue
            self.routed[decision.reason] = self.routed.get(decision.reason, 0) + 1
            return handle

    def _retry(self, handle: RequestHandle) -> bool:
        """A replica failed `handle` before its first token: try it on another one (a
        prefill-only request on another prefill engine; with none, on any engine, computing
        the whole request itself)."""
        if len(handle.tried) >= self.max_attempts:
            return False
        role = None
        if handle.prefill_phase:
            role = "prefill" if self._routable_loads("prefill")[1] else None
            if role is None:
                handle.submit_msg.ClearField("kv_handoff")
                handle.prefill_phase = False
                self._count_handoff("prefill_lost_computed_whole")
            else:
                self._count_handoff("prefill_lost_retried")
        by_id, loads = self._routable_loads(role)
        decision = self.router.choose(loads, handle.prompt_token_ids, exclude=handle.tried)
        if decision is None or not by_id[decision.replica_id].client.adopt(handle):
            log.warning("request %s: replica %s failed it before its first token and no "
                        "other replica can take it", handle.request_id, handle.tried[-1])
            return False
        self.retries += 1
        log.warning("request %s: replica %s failed it before its first token; resubmitted "
                    "to %s", handle.request_id, handle.tried[-2], decision.replica_id)
        return True

    def _count_handoff(self, outcome: str) -> None:
        self.handoffs[outcome] = self.handoffs.get(outcome, 0) + 1

    def _continue_on_decode(self, handle: RequestHandle, result: "pb.engine.KvHandoffResult | None") -> bool:
        """A prefill engine is done with `handle`: submit the rest to the decode engine with the
        least outstanding work (least KV in use), with its tokens so far and the number of
        prompt blocks the kvstore holds for it (0: the decode engine recomputes the prompt).
        With no decode engine routable, any engine takes it (the prefill one keeps the prompt's
        blocks cached, so this costs one lookup)."""
        blocks = result.num_kv_blocks if result is not None else 0
        sub = pb.engine.EngineSubmit()
        sub.CopyFrom(handle.submit_msg)
        sub.kv_handoff.Clear()
        sub.kv_handoff.resume_token_ids.extend(handle.generated_ids)
        sub.kv_handoff.num_kv_blocks = blocks
        direct = result is not None and bool(result.peer) and blocks > 0
        if direct:   # copied from the prefill engine's worker, not fetched from the kvstore
            sub.kv_handoff.peer = result.peer
            sub.kv_handoff.src_block_ids.extend(result.block_ids)
            sub.kv_handoff.lease_deadline_unix_ns = result.lease_deadline_unix_ns
        sub.sampling.ClearField("prompt_logprobs")   # delivered with the first token already
        for role in ("decode", None):
            if role is None and direct:
                # A colocated fallback (maybe the prefill engine itself, which still holds the blocks
                # under this request id): release them first and let the engine find them in its
                # own prefix cache rather than copy freed blocks.
                handle.release_now()
                sub.kv_handoff.num_kv_blocks = 0
                sub.kv_handoff.ClearField("peer")
                sub.kv_handoff.ClearField("src_block_ids")
                sub.kv_handoff.lease_deadline_unix_ns = 0
                direct = False
            by_id, loads = self._routable_loads(role)
            for load in sorted(loads, key=lambda x: x.outstanding_tokens):
                if by_id[load.replica_id].client.continue_request(handle, sub):
                    outcome = (("direct" if direct else "kvstore") if blocks else "recompute") if role \
                        else "colocated_fallback"
                    self._count_handoff(outcome)
                    telemetry.set_attributes(handle.handoff_span, {"meshllm.kv.handoff_outcome": outcome})
                    return True
        self._count_handoff("no_engine")
        handle.release_now()
        return False

    async def reset_prefix_cache(self, timeout_s: float, tiers: bool = False) -> list[dict]:
        """Engine.ResetPrefixCache on every replica at once: one outcome per replica.

        A replica that is STARTING, RESTARTING or DEAD runs (or will run) a fresh process
        whose cache is empty: it is skipped. Every other one is asked, drained ones too
        (they still hold a cache and may be undrained)."""
        async def one(r: Replica) -> dict:
            out = {"replica": r.spec.replica_id, "address": r.spec.address, "state": r.spec.state}
            if r.spec.state in ("STARTING", "RESTARTING", "DEAD"):
                return {**out, "status": "skipped", "reason": f"{r.spec.state.lower()}: no cache to flush"}
            try:
                reply = await r.client.reset_prefix_cache(timeout_s, tiers)
            except grpc.aio.AioRpcError as err:
                return {**out, "status": "error", "error": f"{err.code().name}: {err.details()}"}
            done = {**out, "status": "ok", "num_blocks_flushed": reply.num_blocks_flushed,
                    "num_blocks_cached": reply.num_blocks_cached}
            if tiers:
                done["num_tier_blocks_flushed"] = reply.num_tier_blocks_flushed
            return done
        return list(await asyncio.gather(*(one(r) for r in list(self._replicas.values()))))

    def fail_all(self, message: str) -> None:
        for r in self._replicas.values():
            r.client.fail_all(message)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        for r in self._replicas.values():
            r.client.start()
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await asyncio.gather(*(r.client.close() for r in self._replicas.values()),
                             *self._background, return_exceptions=True)

    async def poll_health(self) -> None:
        replicas = list(self._replicas.values())
        await asyncio.gather(*(r.poll_health(max(self.health_interval_s, 1.0))
                               for r in replicas))
        for r in replicas:
            if r.was_routable != r.routable:
                r.was_routable = r.routable
                log.info("engine replica %s is %s", r.spec.replica_id,
                         "routable" if r.routable else f"not routable ({r.describe()})")
                if not r.routable and self.connected:
                    moved = r.client.move_unstarted()
                    if moved:
                        log.warning("moved %d requests without a first token off %s", moved,
                                    r.spec.replica_id)

    async def _health_loop(self) -> None:
        while True:
            await self.poll_health()
            await asyncio.sleep(self.health_interval_s)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def reset_prefix_caches(engines: EnginePool, tiers: bool = False) -> tuple[dict, str | None]:
    """Flush every replica (HTTP and gRPC share this), with `tiers` their KV tiers too: the
    report, and why it counts as a failure (a replica failed, or none could be asked) or None."""
    outcomes = await engines.reset_prefix_cache(RESET_TIMEOUT_S, tiers)
    report = {"num_blocks_flushed": sum(o.get("num_blocks_flushed", 0) for o in outcomes),
              "replicas": outcomes}
    if tiers:   # replicas usually share one kvstore: the first that flushed counted its blocks
        report["num_tier_blocks_flushed"] = sum(max(0, o.get("num_tier_blocks_flushed", 0)) for o in outcomes)
    failed = [f"{o['replica']} ({o['error']})" for o in outcomes if o["status"] == "error"]
    if failed:
        return report, f"the prefix cache was not flushed on {', '.join(failed)}"
    if not any(o["status"] == "ok" for o in outcomes):
        return report, "no engine replica could be asked to flush its prefix cache"
    return report, None
