"""The worker's I/O: a ZMQ ROUTER for WorkerRequest/WorkerReply, and grpc.health.v1.

The model runs on one engine thread that owns the ZMQ socket; the asyncio loop only serves
health, so readiness answers even while a long step runs (torch releases the GIL).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch
import zmq
from google.protobuf.message import DecodeError

from services.common import pb
from services.common.procs import install_stop_handlers
from services.worker.config import WorkerConfig
from services.worker.models import load_model
from services.worker.models.config import ModelConfigError
from services.worker.runner import ModelRunner, PlanError
from services.worker.zmq_link import open_endpoints

log = logging.getLogger("meshllm.worker")

_POLL_MS = 100


class _Stats:
    """Counters for the periodic INFO summary."""

    def __init__(self) -> None:
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.since, self.steps, self.tokens, self.sampled, self.errors, self.busy_ns = now, 0, 0, 0, 0, 0


class Engine:
    """Owns the runner and the ROUTER socket; `run()` is the engine thread's body."""

    def __init__(self, cfg: WorkerConfig, sock: zmq.Socket) -> None:
        self.cfg = cfg
        self.sock = sock
        self.runner: ModelRunner | None = None
        self.stop_flag = threading.Event()
        self.failed: BaseException | None = None
        self.stats = _Stats()

    def load(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        t0 = time.monotonic()
        model = load_model(self.cfg.model, self.cfg.device, self.cfg.torch_dtype,
                           self.cfg.max_model_len or None)
        self.runner = ModelRunner(model, model_name=self.cfg.served_model_name,
                                  kv_cache_bytes=self.cfg.kv_cache_bytes,
                                  num_kv_blocks=self.cfg.num_kv_blocks or None,
                                  block_size=self.cfg.block_size,
                                  enforce_eager=self.cfg.enforce_eager)
        log.info("model %s ready in %.1fs on %s (%s, %d threads), max_model_len %d",
                 self.cfg.served_model_name, time.monotonic() - t0, self.cfg.device,
                 str(model.dtype).removeprefix("torch."), torch.get_num_threads(), model.max_model_len)

    def handle(self, payload: bytes) -> pb.step.WorkerReply:
        req = pb.step.WorkerRequest()
        try:
            req.ParseFromString(payload)
        except DecodeError:
            return _error_reply(0, "undecodable WorkerRequest")
        kind = req.WhichOneof("kind")
        if kind == "hello":
            try:
                info = self.runner.hello(req.hello.block_size)
            except PlanError as exc:
                log.error("hello rejected: %s", exc)
                return _error_reply(0, str(exc))
            log.info("scheduler hello: block_size %d -> %d KV blocks", info.block_size, info.num_kv_blocks)
            return pb.step.WorkerReply(info=info)
        if kind == "plan":
            return pb.step.WorkerReply(result=self._step(req.plan))
        return _error_reply(0, "empty WorkerRequest")

    def _step(self, plan: pb.step.StepPlan) -> pb.step.StepResult:
        result = self.runner.execute(plan)
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
        log.debug("step %d: new %d cached %d finished %d tokens %d sampled %d %.1fms%s",
                  plan.step_id, len(plan.new_requests), len(plan.cached_requests), len(plan.finished_ids),
                  num_tokens, num_sampled, result.forward_ns / 1e6,
                  " error" if result.HasField("error") else "")
        return result

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
            while not self.stop_flag.is_set():
                if poller.poll(_POLL_MS):
                    frames = self.sock.recv_multipart()
                    # [identity, (empty delimiter,) payload]: reply on the same envelope.
                    reply = self.handle(frames[-1])
                    self.sock.send_multipart([*frames[:-1], reply.SerializeToString()])
                self._maybe_log_summary()
        except ModelConfigError as exc:
            self.failed = exc
            log.error("cannot serve %s: %s", self.cfg.model, exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            self.failed = exc
            log.exception("worker engine failed")
        finally:
            self.sock.close(linger=0)
            on_exit()


def _error_reply(step_id: int, message: str) -> pb.step.WorkerReply:
    reply = pb.step.WorkerReply(result=pb.step.StepResult(step_id=step_id))
    reply.result.error.code = pb.common.ERROR_CODE_INVALID_ARGUMENT
    reply.result.error.message = message
    return reply


async def serve(cfg: WorkerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_handlers(loop, stop)
    endpoints = await open_endpoints(cfg, log)
    if endpoints is None:
        return 1
    server, health, ctx, sock = endpoints
    engine = Engine(cfg, sock)
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
    if thread.is_alive():  # stuck in a step: the process exits anyway (daemon thread)
        log.error("engine thread did not stop in 30s")
        return 1
    ctx.term()
    if engine.failed is not None:
        return 1
    log.info("worker stopped")
    return 0
