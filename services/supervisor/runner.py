"""The supervisor's adapter: starts and kills processes, probes their health, and feeds
what it sees to one ReplicaMachine per replica (state.py). Publishes the replica set to
watchers (server.py) and to Prometheus.

A failed replica is killed whole with SIGKILL (an engine is a scheduler and its worker: the
worker holds the scheduler's request state, so one never outlives the other) and started
again with the same arguments, hence the same ports: addresses stay stable. Every child gets
PR_SET_PDEATHSIG, so none outlives the supervisor even when it is SIGKILLed."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb
from services.common.grpc_server import channel
from services.common.procs import die_with_parent
from services.supervisor import metrics
from services.supervisor.config import SupervisorConfig
from services.supervisor.state import Probe, ProbeResult, ReplicaMachine, State

log = logging.getLogger("meshllm.supervisor")

_STATE_PB = {State.STARTING: pb.supervisor.REPLICA_STATE_STARTING, State.READY: pb.supervisor.REPLICA_STATE_READY,
             State.DRAINING: pb.supervisor.REPLICA_STATE_DRAINING, State.DEAD: pb.supervisor.REPLICA_STATE_DEAD,
             State.RESTARTING: pb.supervisor.REPLICA_STATE_RESTARTING,
             State.NOT_READY: pb.supervisor.REPLICA_STATE_NOT_READY}


# A restarted service must be seen ready within a probe round or two: gRPC's default
# reconnect backoff grows to two minutes while the port is closed.
_PROBE_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                          ("grpc.max_reconnect_backoff_ms", 1000)]


class Replica:
    """One replica's spec, its machine and its current processes."""

    def __init__(self, spec: "pb.supervisor.ReplicaSpec", machine: ReplicaMachine) -> None:
        self.spec = spec
        self.machine = machine
        self.procs: list[subprocess.Popen] = []
        self.kind_name = pb.supervisor.ReplicaKind.Name(spec.kind).removeprefix("REPLICA_KIND_").lower()

    def exited(self) -> str | None:
        """Why the replica is dead, if one of its processes has exited."""
        for spec, p in zip(self.spec.processes, self.procs):
            if p.poll() is not None:
                how = (f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0
                       else f"exited with code {p.returncode}")
                return f"{spec.module} (pid {p.pid}) {how}"
        return None


def _policy_of(cfg: SupervisorConfig, spec: "pb.supervisor.ReplicaSpec"):
    if spec.unhealthy_after_s > 0:
        return dataclasses.replace(cfg.policy, unhealthy_after_s=spec.unhealthy_after_s)
    return cfg.policy


class Supervisor:
    def __init__(self, cfg: SupervisorConfig) -> None:
        self.cfg = cfg
        self.replicas = [Replica(s, ReplicaMachine(s.id, _policy_of(cfg, s), s.restart_when_unready))
                         for s in cfg.spec.replicas]
        self.version = 0
        self._snapshot: list[pb.supervisor.Replica] = []
        self._changed = asyncio.Condition()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stopping = False
        self._mono0, self._wall0 = time.monotonic(), time.time()

    # ---- processes ----------------------------------------------------------------------
    def _spawn(self, r: Replica) -> None:
        env_base = {**os.environ, "MESHLLM_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        r.procs = []
        for p in r.spec.processes:
            env = {**env_base, **dict(p.env)}
            # Own process group: a terminal's Ctrl-C reaches only the launcher, which stops
            # the supervisor, which stops these in order (gateway first).
            r.procs.append(subprocess.Popen([sys.executable, "-m", f"services.{p.module}", *p.args], env=env,
                                            preexec_fn=die_with_parent, stdin=subprocess.DEVNULL,
                                            process_group=0))
        r.machine.started(time.monotonic())
        log.info("started %s: pids %s", r.spec.id, [p.pid for p in r.procs])

    @staticmethod
    async def _kill(r: Replica) -> None:
        """SIGKILL works on a stopped (SIGSTOP) process too; reap so the ports are free again."""
        for p in r.procs:
            if p.poll() is None:
                p.kill()
        for p in r.procs:
            await asyncio.to_thread(p.wait)

    async def stop_all(self) -> None:
        """Graceful shutdown: the gateway first (it finishes its in-flight requests, which
        needs the engines and tokenizers), then everything else; SIGKILL after the grace."""
        self._stopping = True
        first = [r for r in self.replicas if r.spec.kind == pb.supervisor.REPLICA_KIND_GATEWAY]
        rest = [r for r in self.replicas if r not in first]
        for group in (first, rest):
            procs = [p for r in group for p in reversed(r.procs) if p.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGCONT)   # a stopped (SIGSTOP) child acts on it now
            deadline = time.monotonic() + self.cfg.stop_grace_s
            for p in procs:
                try:
                    await asyncio.to_thread(p.wait, max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("pid %d did not stop in %.0fs: killing it", p.pid, self.cfg.stop_grace_s)
                    p.kill()
                    await asyncio.to_thread(p.wait)
        for ch in self._channels.values():
            await ch.close()

    # ---- probes -------------------------------------------------------------------------
    async def _probe(self, spec: "pb.supervisor.ProcessSpec") -> ProbeResult:
        mode = spec.probe or (pb.supervisor.PROBE_GRPC_HEALTH if spec.health_addr else pb.supervisor.PROBE_NONE)
        timeout = self.cfg.health_timeout_s
        if mode == pb.supervisor.PROBE_NONE:
            return ProbeResult(Probe.SERVING)
        if mode == pb.supervisor.PROBE_TCP:
            host, port = spec.health_addr.rsplit(":", 1)
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
                writer.close()
                return ProbeResult(Probe.SERVING)
            except (OSError, asyncio.TimeoutError) as exc:
                return ProbeResult(Probe.UNREACHABLE, f"{spec.module} {spec.health_addr}: {exc!r}")
        ch = self._channels.get(spec.health_addr)
        if ch is None:
            ch = self._channels[spec.health_addr] = channel(
                spec.health_addr, _PROBE_CHANNEL_OPTIONS, credentials=self.cfg.internal_tls.channel_credentials())
        try:
            resp = await hpb_grpc.HealthStub(ch).Check(hpb.HealthCheckRequest(service=spec.health_service),
                                                       timeout=timeout)
        except grpc.aio.AioRpcError as err:
            return ProbeResult(Probe.UNREACHABLE, f"{spec.module} {spec.health_addr}: {err.code().name}")
        if resp.status == hpb.HealthCheckResponse.SERVING:
            return ProbeResult(Probe.SERVING)
        return ProbeResult(Probe.NOT_SERVING, f"{spec.module} {await self._reason(ch, spec.module)}".strip())

    async def _reason(self, ch: grpc.aio.Channel, module: str) -> str:
        """The service's own words for why it is not ready (meshllm.v1.Status), if it says."""
        try:
            st = await pb.health_grpc.StatusStub(ch).GetStatus(pb.health.StatusRequest(),
                                                               timeout=self.cfg.health_timeout_s)
            return st.reason
        except grpc.aio.AioRpcError:
            return "NOT_SERVING"

    async def _check(self, r: Replica) -> None:
        m = r.machine
        if m.state is State.DEAD:
            return
        now = time.monotonic()
        if m.state is State.RESTARTING:
            if m.restart_due(now) and not self._stopping:
                self._spawn(r)
            return
        exited = r.exited()
        probes = [] if exited else await asyncio.gather(*(self._probe(p) for p in r.spec.processes))
        failure = m.observe(time.monotonic(), exited, probes)
        if failure is None or self._stopping:
            return
        await self._kill(r)
        delay = m.failed(time.monotonic(), failure)
        metrics.failed(r)
        if delay is None:
            log.error("%s is DEAD: %s", r.spec.id, m.reason)
        else:
            log.warning("%s failed: %s", r.spec.id, m.reason)

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        for r in self.replicas:
            self._spawn(r)
        await self._publish()
        while not self._stopping:
            t0 = time.monotonic()
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await self._publish()
            await asyncio.sleep(max(0.05, self.cfg.health_interval_s - (time.monotonic() - t0)))

    # ---- publishing ---------------------------------------------------------------------
    def _to_pb(self, r: Replica) -> "pb.supervisor.Replica":
        m = r.machine
        alive = m.state not in (State.RESTARTING, State.DEAD)
        return pb.supervisor.Replica(
            id=r.spec.id, kind=r.spec.kind, rank=r.spec.rank, addr=r.spec.addr, state=_STATE_PB[m.state],
            reason=m.reason, restarts=m.restarts, pids=[p.pid for p in r.procs] if alive else [],
            since_unix_s=self._wall0 + (m.since - self._mono0), metrics_url=r.spec.metrics_url,
            role=r.spec.role)

    async def _publish(self) -> None:
        snapshot = [self._to_pb(r) for r in self.replicas]
        if snapshot == self._snapshot:
            return
        self._snapshot = snapshot
        self.version += 1
        metrics.publish(self.replicas)
        async with self._changed:
            self._changed.notify_all()

    def replica_set(self, kind: int = 0) -> "pb.supervisor.ReplicaSet":
        return pb.supervisor.ReplicaSet(
            replicas=[r for r in self._snapshot if not kind or r.kind == kind], version=self.version)

    async def wait_change(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != version or self._stopping)

    def find(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.spec.id == replica_id), None)

    async def set_draining(self, r: Replica, draining: bool) -> "pb.supervisor.Replica":
        (r.machine.drain if draining else r.machine.undrain)(time.monotonic())
        log.info("%s %s", r.spec.id, "draining" if draining else "undrained")
        await self._publish()
        return self._to_pb(r)
