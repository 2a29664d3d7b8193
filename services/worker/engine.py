"""The worker's engine loop and serve(): one thread owns the ZMQ ROUTER and drives a runner.

The runner is the real ModelRunner (load.py) or the no-compute SimulatedRunner (simulated.py);
main.py picks one and hands serve() its RunnerSource. Both keep the same interface (`Runner`
below), so the loop, the metrics, step tracing, error replies and the summary log are the same
code for both. Messages cross wire.py both ways; nothing here reads a protobuf field.

The model runs on the engine thread; the asyncio loop only serves health and WorkerControl, so
readiness answers even while a long step runs (torch releases the GIL).

When the runner overlaps steps (ModelRunner on a GPU), the engine submits a plan, and while that
step runs it takes the next plan the scheduler already sent (async scheduling) and submits it
too, and only then replies with the first step's result. Replies keep the plans' order.

Tensor parallel: rank 0's engine fans each request's bytes out to the other ranks (its TpLink)
before running it; ranks > 0 run `handle` on each (tp_ranks.follower_main). The link also
carries what the ranks must agree on (which KV tier jobs ended, tp_ranks.py) inside the fan-out,
and every rank tells it when a hello was handled. Torch-free.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from services.common.gc_heap import freeze_startup_heap
from services.common import telemetry
from services.common.procs import install_stop_handlers
from services.worker import wire
from services.worker.config import WorkerConfig
from services.worker.control import WorkerControlServicer
from services.worker.metrics import WorkerMetrics
from services.worker.plan import INTERNAL, Hello, PlanError, StepPlan, StepResult, WorkerInfo
from services.worker.step_tracing import StepTracer
from services.worker.zmq_link import error_reply, open_endpoints

log = logging.getLogger("meshllm.worker")

_POLL_MS = 100
_SPIN_S = 50e-6   # while a step runs: how often to look for the next plan / the step's end


class Runner(Protocol):
    """What the engine drives. submit and collect never raise: a bad or failed step comes back
    as StepResult.error."""

    overlap: bool                      # may step N+1 be submitted before step N is collected?
    requests: Mapping[str, Any]        # request id -> the runner's state (counted in the summary)

    @property
    def vocab_size(self) -> int: ...   # wire.py checks sampling parameters' token ids against it

    def hello(self, block_size: int) -> WorkerInfo: ...   # PlanError: refused
    def submit(self, plan: StepPlan) -> Any: ...
    def collect(self, pending: Any) -> StepResult: ...
    def ready(self, pending: Any) -> bool: ...           # would collect return without waiting?


class TpFanout(Protocol):
    """A rank's link to the other tensor-parallel ranks, as the engine uses it (tp_ranks.TpLink:
    the engine defines what it needs, so it never imports tp_ranks, which imports the engine).
    send/heartbeat/send_stop are rank 0's; after_hello runs on every rank."""

    rank: int

    def send(self, payload: bytes) -> None: ...   # every rank runs every request
    def after_hello(self) -> None: ...            # every rank, after each hello (a collective)
    def heartbeat(self) -> None: ...              # keep idle ranks inside the collectives' timeout
    def send_stop(self) -> None: ...
    def close(self) -> bool: ...                  # True: the group was torn down cleanly


class StepCapture(Protocol):
    """The profiler as the engine uses it (profiling.StepProfiler; imports torch, so typed here)."""

    active: bool

    def run_step(self, step: Callable[[], StepResult]) -> StepResult: ...
    def tick(self) -> None: ...
    def shutdown(self) -> None: ...


class LoadFailed(Exception):
    """The runner cannot be built for this model directory: one clear line, no traceback."""


class TpStepFailed(RuntimeError):
    """A step failed inside the runner of a tensor-parallel rank: the worker cannot go on."""


@dataclass
class RunnerSource:
    """What serve() needs besides the config; main.py picks the source (load.py or simulated.py)."""

    load: Callable[[], Runner]                 # on the engine thread, before readiness; LoadFailed
    control: WorkerControlServicer             # WorkerControl on the health port
    profiler: StepCapture | None = None       # steps run under its captures (real model only)
    tp: TpFanout | None = None                   # rank 0 of a tensor-parallel worker
    stop_ranks: Callable[[float], None] | None = None  # wait up to N s for the other ranks, then kill


class _Stats:
    """Counters for the periodic INFO summary."""

    def __init__(self) -> None:
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.since, self.steps, self.tokens, self.sampled, self.errors, self.busy_ns = now, 0, 0, 0, 0, 0


class Engine:
    """Owns the runner and the ROUTER socket; `run()` is the engine thread's body."""

    def __init__(self, cfg: WorkerConfig, sock: zmq.Socket | None, load_runner: Callable[[], Runner],
                 tp: TpFanout | None = None, profiler: StepCapture | None = None) -> None:
        self.cfg = cfg
        self.sock = sock           # None on tensor-parallel ranks > 0 (tp_ranks.follower_main)
        self.tp = tp               # tp_ranks.TpLink when --tensor-parallel-size > 1
        self.tp_closed = tp is None
        self.profiler = profiler   # rank 0 of the real model only
        self._load_runner = load_runner
        self.runner: Runner | None = None
        self.stop_flag = threading.Event()
        self.failed: BaseException | None = None
        self.stats = _Stats()
        self.metrics = WorkerMetrics(cfg.served_model_name, cfg.engine_id)
        # Spans of traced requests (services/worker/step_tracing.py); rank 0 only, None when off.
        self.step_tracer = StepTracer() if telemetry.ENABLED and not cfg.tp_rank else None

    def load(self) -> None:
        self.runner = self._load_runner()

    def handle(self, payload: bytes) -> bytes:
        """One request from start to serialized reply (ranks > 0, and rank 0 unpipelined)."""
        req, bad = self._decode(payload)
        return bad if req is None else self._handle_request(req)

    def _decode(self, payload: bytes) -> tuple[Hello | StepPlan | None, bytes | None]:
        try:
            return wire.request_from_bytes(payload, self.runner.vocab_size), None
        except wire.WireError as exc:
            return None, error_reply(str(exc)).SerializeToString()

    def _pipelined(self, req: Hello | StepPlan) -> bool:
        """May this request's step overlap the one in flight? Plans on a GPU, outside captures
        (a profiler capture runs each step whole on its own thread)."""
        return (isinstance(req, StepPlan) and self.runner.overlap
                and not (self.profiler is not None and self.profiler.active))

    def _handle_request(self, req: Hello | StepPlan) -> bytes:
        if isinstance(req, Hello):
            try:
                info = self.runner.hello(req.block_size)
            except PlanError as exc:
                log.error("hello rejected: %s", exc)
                return error_reply(str(exc)).SerializeToString()
            finally:
                if self.tp is not None:   # the same point on every rank
                    self.tp.after_hello()
            log.info("scheduler hello: block_size %d -> %d KV blocks", info.block_size, info.num_kv_blocks)
            return wire.info_reply(info)
        if self.profiler is not None and self.profiler.active:   # a "meshllm.step" range
            return wire.result_reply(self.profiler.run_step(lambda: self._step(req)))
        return wire.result_reply(self._step(req))

    def _step(self, plan: StepPlan) -> StepResult:
        start_ns = time.time_ns()
        return self._after_step(plan, self.runner.collect(self.runner.submit(plan)), start_ns)

    def _after_step(self, plan: StepPlan, result: StepResult, start_ns: int) -> StepResult:
        failed = result.error is not None
        if self.tp is not None and failed and result.error.code == INTERNAL:
            # Bad plans fail alike on every rank before any collective; a failure inside the
            # forward may leave the ranks disagreeing or waiting in an all-reduce forever.
            raise TpStepFailed(f"step {plan.step_id} failed on tensor-parallel rank {self.tp.rank}: "
                               f"{result.error.message}")
        if self.step_tracer is not None:
            self.step_tracer.on_step(plan, result, start_ns, time.time_ns())
        s = self.stats
        s.steps += 1
        num_tokens = (sum(r.num_scheduled_tokens for r in plan.new_requests)
                      + sum(r.num_scheduled_tokens for r in plan.cached_requests))
        num_sampled = sum(len(o.token_ids) for o in result.outputs)
        s.tokens += num_tokens
        s.sampled += num_sampled
        s.busy_ns += result.forward_ns
        s.errors += failed
        self.metrics.on_step(result.forward_ns, num_tokens, num_sampled, failed)
        log.debug("step %d: new %d cached %d finished %d tokens %d sampled %d %.1fms%s",
                  plan.step_id, len(plan.new_requests), len(plan.cached_requests), len(plan.finished_ids),
                  num_tokens, num_sampled, result.forward_ns / 1e6, " error" if failed else "")
        return result

    def _reply_step(self, inflight) -> None:
        envelope, plan, pending, start_ns = inflight
        result = self._after_step(plan, self.runner.collect(pending), start_ns)
        self.sock.send_multipart([*envelope, wire.result_reply(result)])

    def _maybe_log_summary(self) -> None:
        s, now = self.stats, time.monotonic()
        if now - s.since < self.cfg.log_every_s:
            return
        if s.steps:
            dt = now - s.since
            log.info("last %.0fs: %d steps, %d tokens run, %d sampled (%.1f tok/s), busy %.0f%%, "
                     "%d errors, %d requests held", dt, s.steps, s.tokens, s.sampled, s.sampled / dt,
                     100 * s.busy_ns / 1e9 / dt, s.errors, len(self.runner.requests))
        s.reset(now)

    def run(self, on_ready: Callable[[], None], on_exit: Callable[[], None]) -> None:
        try:
            self.load()
            freeze_startup_heap(log)   # the model, kernels and imports: no full collection walks them again
            on_ready()
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            inflight = None   # (envelope, plan, pending step, start ns): submitted, not replied
            while not self.stop_flag.is_set():
                if inflight is None:
                    got = poller.poll(_POLL_MS)
                else:  # a step runs: take the next plan if it comes first, else reply when done
                    got = poller.poll(0)
                    if not got and not self.runner.ready(inflight[2]):
                        time.sleep(_SPIN_S)
                        continue
                if got:
                    frames = self.sock.recv_multipart()
                    if self.tp is not None:
                        self.tp.send(frames[-1])  # every rank runs every request
                    # [identity, (empty delimiter,) payload]: reply on the same envelope.
                    req, bad = self._decode(frames[-1])
                    if req is not None and self._pipelined(req):
                        start_ns = time.time_ns()
                        started = (frames[:-1], req, self.runner.submit(req), start_ns)
                        if inflight is not None:
                            self._reply_step(inflight)
                        inflight = started
                    else:
                        if inflight is not None:
                            self._reply_step(inflight)
                            inflight = None
                        reply = bad if req is None else self._handle_request(req)
                        self.sock.send_multipart([*frames[:-1], reply])
                elif inflight is not None:
                    self._reply_step(inflight)
                    inflight = None
                elif self.tp is not None:
                    self.tp.heartbeat()
                if self.profiler is not None:
                    self.profiler.tick()   # start a requested capture, end one past its bounds
                self._maybe_log_summary()
            if inflight is not None:
                self._reply_step(inflight)
            if self.tp is not None:
                self.tp.send_stop()
                self.tp_closed = self.tp.close()
        except LoadFailed as exc:
            self.failed = exc
            log.error("cannot serve %s: %s", self.cfg.model, exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            self.failed = exc
            log.exception("worker engine failed")
        finally:
            if self.profiler is not None:
                self.profiler.shutdown()
            self.sock.close(linger=0)
            on_exit()


async def serve(cfg: WorkerConfig, make_source: Callable[[WorkerConfig], RunnerSource]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_handlers(loop, stop)
    try:  # before the gRPC server's threads exist: tensor-parallel ranks are forked from this process
        source = make_source(cfg)
    except LoadFailed as exc:
        log.error("cannot serve %s: %s", cfg.model, exc)
        return 1
    endpoints = await open_endpoints(cfg, log, source.control)
    if endpoints is None:
        if source.stop_ranks is not None:
            source.stop_ranks(0.0)
        return 1
    server, health, ctx, sock = endpoints
    engine = Engine(cfg, sock, source.load, source.tp, source.profiler)
    thread = threading.Thread(
        target=engine.run, name="worker-engine", daemon=True,
        args=(lambda: loop.call_soon_threadsafe(health.set_ready, True),
              lambda: loop.call_soon_threadsafe(stop.set)))
    thread.start()
    await stop.wait()
    health.set_ready(False, "stopping")
    engine.stop_flag.set()
    await asyncio.to_thread(thread.join, 30.0)
    await server.stop(1.0)
    if source.stop_ranks is not None:  # told to stop after a clean exit; otherwise they may be stuck: kill
        clean = engine.failed is None and not thread.is_alive()
        await asyncio.to_thread(source.stop_ranks, 10.0 if clean else 0.0)
    if thread.is_alive():  # stuck in a step: the process exits anyway (daemon thread)
        log.error("engine thread did not stop in 30s")
        return 1
    ctx.term()
    if engine.failed is not None:
        return 1
    log.info("worker stopped")
    if not engine.tp_closed:  # the teardown thread may sit in NCCL forever: do not wait at exit
        logging.shutdown()
        os._exit(0)
    return 0
