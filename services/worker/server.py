"""The worker's I/O: a ZMQ ROUTER for WorkerRequest/WorkerReply, and grpc.health.v1.

The model runs on one engine thread that owns the ZMQ socket; the asyncio loop only serves
health, so readiness answers even while a long step runs (torch releases the GIL).

On a GPU the engine overlaps steps (runner.py): it submits a plan, and while that step runs it
takes the next plan the scheduler already sent (async scheduling) and submits it too, and only
then replies with the first step's result. Replies keep the plans' order.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import torch
import zmq
from google.protobuf.message import DecodeError

from services.common import pb, telemetry
from services.common.procs import install_stop_handlers
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.models import load_model
from services.worker.models.config import ModelConfigError
from services.worker.runner import ModelRunner, PlanError
from services.worker.control import WorkerControlServicer
from services.worker.profiling import StepProfiler
from services.worker.step_tracing import StepTracer
from services.worker.zmq_link import error_reply, open_endpoints

log = logging.getLogger("meshllm.worker")

_POLL_MS = 100
_SPIN_S = 50e-6   # while a step runs: how often to look for the next plan / the step's end


class _Stats:
    """Counters for the periodic INFO summary."""

    def __init__(self) -> None:
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.since, self.steps, self.tokens, self.sampled, self.errors, self.busy_ns = now, 0, 0, 0, 0, 0


class Engine:
    """Owns the runner and the ROUTER socket; `run()` is the engine thread's body."""

    def __init__(self, cfg: WorkerConfig, sock: zmq.Socket | None, tp=None) -> None:
        self.cfg = cfg
        self.sock = sock           # None on tensor-parallel ranks > 0 (tp_ranks.follower_main)
        self.tp = tp               # tp_ranks.TpLink when --tensor-parallel-size > 1
        self.tp_closed = tp is None
        self.runner: ModelRunner | None = None
        self.stop_flag = threading.Event()
        self.failed: BaseException | None = None
        self.stats = _Stats()
        self.profiler: StepProfiler | None = None   # set by serve() (rank 0 only)
        self.metrics = WorkerMetrics(cfg.served_model_name, cfg.engine_id)
        # Spans of traced requests (services/worker/step_tracing.py); rank 0 only, None when off.
        self.step_tracer = StepTracer() if telemetry.ENABLED and not cfg.tp_rank else None

    def load(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        t0 = time.monotonic()
        device = torch.device(self.cfg.rank_device)
        if self.tp is not None:
            self.tp.connect(device)
        model = load_model(self.cfg.model, device, self.cfg.torch_dtype, self.cfg.max_model_len or None)
        if self.tp is not None:
            from services.worker.tp import shard_model
            model = shard_model(model, self.tp.rank, self.tp.size, self.tp.group)
        self.runner = ModelRunner(model, model_name=self.cfg.served_model_name,
                                  kv_cache_bytes=self.cfg.kv_cache_bytes,
                                  num_kv_blocks=self.cfg.num_kv_blocks or None,
                                  block_size=self.cfg.block_size,
                                  enforce_eager=self.cfg.enforce_eager,
                                  kv_cache_dtype=self.cfg.kv_torch_dtype,
                                  seed_rng=self.tp.seed_rng if self.tp is not None else None)
        if self.cfg.overlap_steps != "auto":
            self.runner.overlap = self.cfg.overlap_steps == "on"
        if self.tp is not None:
            self.tp.barrier()  # ready means every rank holds its shard and KV cache
        log.info("model %s ready in %.1fs on %s (%s, %d threads), max_model_len %d, step overlap %s",
                 self.cfg.served_model_name, time.monotonic() - t0, device,
                 str(model.dtype).removeprefix("torch."), torch.get_num_threads(), model.max_model_len,
                 "on" if self.runner.overlap else "off")

    def handle(self, payload: bytes) -> pb.step.WorkerReply:
        """One request from start to reply (tensor-parallel ranks > 0, and rank 0 unpipelined)."""
        req, bad = self._parse(payload)
        return bad if bad is not None else self._handle_request(req)

    @staticmethod
    def _parse(payload: bytes) -> tuple[pb.step.WorkerRequest | None, pb.step.WorkerReply | None]:
        req = pb.step.WorkerRequest()
        try:
            req.ParseFromString(payload)
        except DecodeError:
            return None, error_reply("undecodable WorkerRequest")
        return req, None

    def _pipelined(self, req: pb.step.WorkerRequest) -> bool:
        """May this request's step overlap the one in flight? Plans on a GPU, outside captures
        (a profiler capture runs each step whole on its own thread)."""
        return (req.WhichOneof("kind") == "plan" and self.runner.overlap
                and not (self.profiler is not None and self.profiler.active))

    def _handle_request(self, req: pb.step.WorkerRequest) -> pb.step.WorkerReply:
        kind = req.WhichOneof("kind")
        if kind == "hello":
            try:
                info = self.runner.hello(req.hello.block_size)
            except PlanError as exc:
                log.error("hello rejected: %s", exc)
                return error_reply(str(exc))
            log.info("scheduler hello: block_size %d -> %d KV blocks", info.block_size, info.num_kv_blocks)
            return pb.step.WorkerReply(info=info)
        if kind == "plan":
            if self.profiler is not None and self.profiler.active:   # a "meshllm.step" range
                return pb.step.WorkerReply(result=self.profiler.run_step(lambda: self._step(req.plan)))
            return pb.step.WorkerReply(result=self._step(req.plan))
        return error_reply("empty WorkerRequest")

    def _step(self, plan: pb.step.StepPlan) -> pb.step.StepResult:
        start_ns = time.time_ns()
        return self._after_step(plan, self.runner.execute(plan), start_ns)

    def _after_step(self, plan: pb.step.StepPlan, result: pb.step.StepResult, start_ns: int) -> pb.step.StepResult:
        tracer = self.step_tracer
        if self.tp is not None and result.error.code == pb.common.ERROR_CODE_INTERNAL:
            # Bad plans fail alike on every rank before any collective; a failure inside the
            # forward may leave the ranks disagreeing or waiting in an all-reduce forever.
            from services.worker.tp_ranks import TpStepFailed
            raise TpStepFailed(f"step {plan.step_id} failed on tensor-parallel rank {self.tp.rank}: "
                               f"{result.error.message}")
        if tracer is not None:
            tracer.on_step(plan, result, start_ns, time.time_ns())
        s = self.stats
        s.steps += 1
        num_tokens = (sum(r.num_scheduled_tokens for r in plan.new_requests)
                      + sum(r.num_scheduled_tokens for r in plan.cached_requests))
        num_sampled = sum(len(o.token_ids) for o in result.outputs)
        s.tokens += num_tokens
        s.sampled += num_sampled
        s.busy_ns += result.forward_ns
        if result.HasField("error"):
            s.errors += 1
        self.metrics.on_step(result.forward_ns, num_tokens, num_sampled, result.HasField("error"))
        log.debug("step %d: new %d cached %d finished %d tokens %d sampled %d %.1fms%s",
                  plan.step_id, len(plan.new_requests), len(plan.cached_requests), len(plan.finished_ids),
                  num_tokens, num_sampled, result.forward_ns / 1e6,
                  " error" if result.HasField("error") else "")
        return result

    def _reply_step(self, inflight) -> None:
        envelope, plan, pending, start_ns = inflight
        result = self._after_step(plan, self.runner.collect(pending), start_ns)
        self.sock.send_multipart([*envelope, pb.step.WorkerReply(result=result).SerializeToString()])

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

    def run(self, on_ready, on_exit) -> None:
        try:
            self.load()
            on_ready()
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            inflight = None   # (envelope, plan, PendingStep, start ns): submitted, not replied
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
                    req, bad = self._parse(frames[-1])
                    if bad is None and self._pipelined(req):
                        start_ns = time.time_ns()
                        started = (frames[:-1], req.plan, self.runner.submit(req.plan), start_ns)
                        if inflight is not None:
                            self._reply_step(inflight)
                        inflight = started
                    else:
                        if inflight is not None:
                            self._reply_step(inflight)
                            inflight = None
                        reply = bad if bad is not None else self._handle_request(req)
                        self.sock.send_multipart([*frames[:-1], reply.SerializeToString()])
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
        except ModelConfigError as exc:
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


async def serve(cfg: WorkerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_handlers(loop, stop)
    tp = ranks = None
    if cfg.tensor_parallel_size > 1:
        from services.worker.tp_ranks import TpLink, start_ranks
        try:  # before the gRPC server's threads exist: the ranks are forked from this process
            cfg, ranks = start_ranks(cfg)
        except ModelConfigError as exc:
            log.error("cannot serve %s: %s", cfg.model, exc)
            return 1
        tp = TpLink(cfg)
    profiler = StepProfiler(cfg.profile_dir, cfg.rank_device)
    endpoints = await open_endpoints(cfg, log, WorkerControlServicer(profiler))
    if endpoints is None:
        if ranks is not None:
            ranks.stop(0.0)
        return 1
    server, health, ctx, sock = endpoints
    engine = Engine(cfg, sock, tp)
    engine.profiler = profiler
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
    if ranks is not None:  # told to stop after a clean exit; otherwise they may be stuck: kill
        clean = engine.failed is None and not thread.is_alive()
        await asyncio.to_thread(ranks.stop, 10.0 if clean else 0.0)
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
