"""ProfilerControl: one capture at a time, fanned out to the workers' WorkerControl, with an
optional trace-sampling change on every service for the capture's duration.

- Start claims the single capture slot before its first await, so a concurrent Start gets
  ALREADY_EXISTS; the slot stays taken until every worker's trace is written or given up on.
- Each worker ends its capture at its own bound; a watcher task polls the workers, sends a
  backstop StopProfile a few seconds past the time bound (a worker that missed it, or one that
  only had a step bound and no traffic, under the hard cap), restores the sampling ratios
  and records the trace files.
- Stop only signals the workers (each call capped at stop_timeout_s) and returns; traces are
  written in the background and appear in Status.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc

from services.common import pb
from services.common.grpc_server import bind, channel, make_server
from services.common.metrics import start_metrics_server
from services.common.procs import install_stop_handlers
from services.common.profiling import MAX_CAPTURE_SECONDS, ProfileRequestError, check_bounds
from services.profiler.capture import Capture, Target, new_capture_id
from services.profiler.config import ProfilerConfig

log = logging.getLogger("meshllm.profiler")

C = pb.control
SERVICE_NAME = "meshllm.v1.ProfilerControl"
# Past a capture's time bound the worker normally has ended it itself; the backstop allows
# for the first capture's Kineto warm-up (~1.5 s) and a long step before stepping in.
_BACKSTOP_GRACE_S = 10.0


def _rpc_error(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details() or ''}".strip()


class ProfilerControlServicer(pb.control_grpc.ProfilerControlServicer):
    def __init__(self, cfg: ProfilerConfig) -> None:
        self.cfg = cfg
        creds = cfg.internal_tls.channel_credentials()
        self._channels: list[grpc.aio.Channel] = []
        self._workers: dict[str, tuple[str, pb.control_grpc.WorkerControlStub]] = {}
        for name, addr in cfg.workers:
            self._workers[name] = (addr, pb.control_grpc.WorkerControlStub(self._channel(addr, creds)))
        # (name, address, stub, call metadata) of every service whose sampling a capture changes
        self._services = [(name, addr, pb.control_grpc.TelemetryControlStub(self._channel(addr, creds)), ())
                          for name, addr in cfg.services]
        if cfg.gateway_addr:
            # The gateway's public port: plain gRPC, and TelemetryControl there is admin-only.
            md = (("authorization", f"Bearer {cfg.control_api_key}"),) if cfg.control_api_key else ()
            self._services.append(("gateway", cfg.gateway_addr,
                                   pb.control_grpc.TelemetryControlStub(self._channel(cfg.gateway_addr)), md))
        self._current: Capture | None = None
        self._tasks: set[asyncio.Task] = set()

    def _channel(self, addr: str, creds=None) -> grpc.aio.Channel:
        ch = channel(addr, credentials=creds)
        self._channels.append(ch)
        return ch

    # ---- RPCs -----------------------------------------------------------------------

    async def Start(self, request, context):
        cur = self._current
        if cur is not None and cur.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"capture {cur.capture_id} is {C.CaptureState.Name(cur.state)}; "
                                "one capture at a time (stop it, or wait for its traces)")
        try:
            max_steps, max_seconds = check_bounds(request.bounds.max_steps, request.bounds.max_seconds)
        except ProfileRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        names = list(dict.fromkeys(request.targets)) or list(self._workers)
        unknown = [n for n in names if n not in self._workers]
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown targets {unknown}; workers: {sorted(self._workers)}")
        if not names:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this profiler knows no workers")
        ratio = request.trace_sampling_ratio if request.HasField("trace_sampling_ratio") else None
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"trace_sampling_ratio must be in [0, 1], got {ratio}")
        capture_id = new_capture_id()
        cap = Capture(capture_id, os.path.join(self.cfg.artifact_dir, capture_id), max_steps, max_seconds,
                      [Target(n, self._workers[n][0]) for n in names], ratio)
        self._current = cap   # the slot is ours before the first await
        wreq = C.StartProfileRequest(capture_id=capture_id, activities=request.activities,
                                     output_dir=cap.artifact_dir, record_shapes=request.record_shapes)
        wreq.bounds.max_steps, wreq.bounds.max_seconds = max_steps, max_seconds
        try:
            await asyncio.gather(*(self._start_worker(t, wreq) for t in cap.targets))
            if ratio is not None and any(t.started for t in cap.targets):
                await self._set_sampling(cap, ratio)
        finally:
            # Even when the caller goes away mid-way, whatever started is watched (bounded,
            # sampling restored) and the slot is released.
            if any(t.started for t in cap.targets):
                task = asyncio.create_task(self._watch(cap), name=f"capture-{capture_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                cap.ended, cap.finished = time.monotonic(), True
        if cap.finished:
            reasons = "; ".join(f"{t.name}: {t.error}" for t in cap.targets)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no worker started the capture ({reasons})")
        log.info("capture %s started on %s: max_steps %d max_seconds %.1f sampling %s", capture_id,
                 [t.name for t in cap.targets if t.started], max_steps, max_seconds,
                 "unchanged" if ratio is None else f"{ratio:g}")
        return cap.to_proto()

    async def Stop(self, request, context):
        cap = self._current
        if cap is None:
            return C.CaptureStatus(state=C.CAPTURE_STATE_IDLE, artifact_dir=self.cfg.artifact_dir)
        if cap.state not in (C.CAPTURE_STATE_STARTING, C.CAPTURE_STATE_RUNNING):
            return cap.to_proto()
        cap.stop_requested, cap.ended = "stop", time.monotonic()
        await self._stop_workers(cap)
        log.info("capture %s stopped on request", cap.capture_id)
        return cap.to_proto(stopped_now=True)

    async def Status(self, request, context):
        cap = self._current
        if cap is None:
            return C.CaptureStatus(state=C.CAPTURE_STATE_IDLE, artifact_dir=self.cfg.artifact_dir)
        return cap.to_proto()

    # ---- fan-out --------------------------------------------------------------------

    async def _start_worker(self, t: Target, req) -> None:
        stub = self._workers[t.name][1]
        try:
            t.worker = await stub.StartProfile(req, timeout=self.cfg.rpc_timeout_s)
            t.started = True
        except grpc.aio.AioRpcError as exc:
            t.error = _rpc_error(exc)
            log.warning("worker %s refused capture %s: %s", t.name, req.capture_id, t.error)

    async def _stop_workers(self, cap: Capture) -> None:
        async def one(t: Target) -> None:
            stub = self._workers[t.name][1]
            try:
                t.worker = await stub.StopProfile(C.StopProfileRequest(capture_id=cap.capture_id),
                                                  timeout=self.cfg.stop_timeout_s)
            except grpc.aio.AioRpcError as exc:
                t.error = _rpc_error(exc)
        await asyncio.gather(*(one(t) for t in cap.targets if t.started and not t.final))

    async def _poll_worker(self, cap: Capture, t: Target) -> None:
        stub = self._workers[t.name][1]
        try:
            status = await stub.ProfileStatus(C.ProfileStatusRequest(), timeout=self.cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            t.error = _rpc_error(exc)
            return
        if status.capture_id != cap.capture_id:   # the worker restarted: its capture is gone
            status = C.WorkerProfileStatus(capture_id=cap.capture_id, state=C.CAPTURE_STATE_FAILED,
                                           error="the worker no longer knows this capture (restarted?)")
        t.worker, t.error = status, ""

    async def _set_sampling(self, cap: Capture, ratio: float) -> None:
        """Each change is recorded as soon as it is made, so it is restored even if this
        call is cancelled half way."""
        async def one(name, addr, stub, md):
            change = C.SamplingChange(service=name, address=addr, ratio=ratio)
            try:
                r = await stub.SetTraceSampling(C.SetTraceSamplingRequest(ratio=ratio),
                                                timeout=self.cfg.rpc_timeout_s, metadata=md)
                change.previous_ratio = r.previous_ratio
            except grpc.aio.AioRpcError as exc:
                change.error = _rpc_error(exc)
                log.warning("could not change the sampling of %s: %s", name, change.error)
            cap.sampling.append(change)
        await asyncio.gather(*(one(*s) for s in self._services))

    async def _restore_sampling(self, cap: Capture) -> None:
        by_name = {s[0]: s for s in self._services}

        async def one(change) -> None:
            _, _, stub, md = by_name[change.service]
            try:
                await stub.SetTraceSampling(C.SetTraceSamplingRequest(ratio=change.previous_ratio),
                                            timeout=self.cfg.rpc_timeout_s, metadata=md)
                change.restored = True
            except grpc.aio.AioRpcError as exc:
                change.error = f"restoring: {_rpc_error(exc)}"
        await asyncio.gather(*(one(c) for c in cap.sampling if not c.error))

    async def _watch(self, cap: Capture) -> None:
        """Until every started worker has written (or failed) its trace."""
        backstop_s = (cap.max_seconds or MAX_CAPTURE_SECONDS) + _BACKSTOP_GRACE_S
        stop_sent, give_up_at = False, None
        try:
            while True:
                await asyncio.sleep(self.cfg.poll_interval_s)
                now = time.monotonic()
                running = cap.state == C.CAPTURE_STATE_RUNNING
                if not stop_sent and (cap.stop_requested or (running and now - cap.started > backstop_s)):
                    if not cap.stop_requested:
                        log.warning("capture %s: a worker missed its bound, stopping it", cap.capture_id)
                    await self._stop_workers(cap)
                    stop_sent = True
                await asyncio.gather(*(self._poll_worker(cap, t) for t in cap.targets if not t.final))
                if all(t.final for t in cap.targets):
                    break
                if cap.state != C.CAPTURE_STATE_RUNNING:
                    cap.ended = cap.ended or now
                    give_up_at = give_up_at or now + self.cfg.write_timeout_s
                    if now > give_up_at:
                        for t in cap.targets:
                            if not t.final:
                                t.error = t.error or "the trace was not written in time"
                                t.worker = C.WorkerProfileStatus(capture_id=cap.capture_id,
                                                                 state=C.CAPTURE_STATE_FAILED, error=t.error)
                        break
        finally:
            cap.ended = cap.ended or time.monotonic()
            if cap.sampling:
                await self._restore_sampling(cap)
            cap.finished = True
            log.info("capture %s %s: %s", cap.capture_id, C.CaptureState.Name(cap.state),
                     cap.artifacts or [t.error or (t.worker.error if t.worker else "") for t in cap.targets])

    async def close(self) -> None:
        """On shutdown: stop a running capture so workers still write what they have."""
        cap = self._current
        if cap is not None and cap.state in (C.CAPTURE_STATE_STARTING, C.CAPTURE_STATE_RUNNING):
            cap.stop_requested = "shutdown"
            await self._stop_workers(cap)
        for task in list(self._tasks):
            task.cancel()
        for ch in self._channels:
            await ch.close()


async def serve(cfg: ProfilerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_handlers(loop, stop)
    servicer = ProfilerControlServicer(cfg)
    server, health = make_server("profiler", [SERVICE_NAME])
    pb.control_grpc.add_ProfilerControlServicer_to_server(servicer, server)
    port = bind(server, f"{cfg.host}:{cfg.port}", cfg.internal_tls.server_credentials())
    await server.start()
    metrics_port = start_metrics_server(cfg.host, cfg.metrics_port)
    health.set_ready(True)
    print(f"profiler listening grpc={cfg.host}:{port}"
          + (f" metrics=http://{cfg.host}:{metrics_port}/metrics" if metrics_port else ""), flush=True)
    log.info("profiler on %s:%d: workers %s, services %s%s, artifacts under %s", cfg.host, port,
             [n for n, _ in cfg.workers], [n for n, _ in cfg.services],
             " + gateway" if cfg.gateway_addr else "", cfg.artifact_dir)
    await stop.wait()
    health.set_ready(False, "stopping")
    await servicer.close()
    await server.stop(1.0)
    return 0
