"""A no-compute worker: the worker's ZMQ protocol (step.proto) without a model.

It keeps only token counts per request, "samples" a deterministic pseudo-random token when a
request's scheduled tokens reach the end of its known tokens (as ModelRunner does), and sleeps
a configurable time per step, so the CPU cost of the gateway, tokenizer and scheduler can be
measured alone (`meshllm serve MODEL --simulate-worker --simulate-step-ms 10`).

Plans are handled strictly in order; a decode step runs the token this worker sampled in the
previous step, which the scheduler never sends back — the same contract as the real worker,
so async scheduling (plan N+1 sent before result N arrives) works unchanged. No torch import:
vocabulary, EOS ids, context length and KV geometry come from the model dir's config.json.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import zmq
from google.protobuf.message import DecodeError

from services.common import pb, telemetry
from services.common.procs import install_stop_handlers
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.control import WorkerControlServicer
from services.worker.step_tracing import StepTracer
from services.worker.zmq_link import error_reply, open_endpoints

log = logging.getLogger("meshllm.worker.simulated")

_POLL_MS = 100
_MIN_TOKEN_ID = 100          # skip the low ids, where BPE vocabularies keep special tokens
_MAX_REQUESTS = 65536        # bounds the per-request map against a runaway scheduler


@dataclass(frozen=True)
class SimSpec:
    """What the worker reports in WorkerInfo, read from config.json (+ generation_config.json)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    kv_bytes_per_token: int   # 2 (K and V) * layers * kv_heads * head_dim * 4 bytes (fp32)

    @classmethod
    def from_model_dir(cls, model_dir: str, max_model_len: int = 0) -> "SimSpec":
        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        gen = d / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        heads = int(cfg.get("num_attention_heads", 1))
        head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", heads)) // heads)
        layers = int(cfg.get("num_hidden_layers", 1))
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        return cls(vocab_size=int(cfg["vocab_size"]), eos_token_ids=eos_ids,
                   max_model_len=max_model_len or int(cfg.get("max_position_embeddings", 2048)),
                   kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4)


class SimulatedRunner:
    """Per-request token counts; `execute(plan)` mirrors ModelRunner.execute without a model."""

    def __init__(self, spec: SimSpec, *, model_name: str, kv_cache_bytes: int,
                 num_kv_blocks: int = 0, block_size: int = 16) -> None:
        self.spec, self.model_name = spec, model_name
        self.kv_cache_bytes, self.fixed_num_blocks = kv_cache_bytes, num_kv_blocks
        # request id -> [num_tokens, rng state]; tokens = prompt + outputs sampled so far
        self.requests: dict[str, list[int]] = {}
        self.block_size, self.num_blocks = 0, 0
        self._set_block_size(block_size)

    def _set_block_size(self, block_size: int) -> None:
        if not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {block_size}")
        num = self.fixed_num_blocks or self.kv_cache_bytes // (self.spec.kv_bytes_per_token * block_size)
        if num < 1:
            raise ValueError("the KV cache budget holds no block; raise --kv-cache-memory-gb")
        self.block_size, self.num_blocks = block_size, num

    def hello(self, block_size: int) -> pb.step.WorkerInfo:
        self._set_block_size(block_size)
        self.requests.clear()
        return pb.step.WorkerInfo(num_kv_blocks=self.num_blocks, block_size=self.block_size,
                                  max_model_len=self.spec.max_model_len, vocab_size=self.spec.vocab_size,
                                  eos_token_ids=list(self.spec.eos_token_ids), model_name=self.model_name,
                                  device="simulated")

    def _sample(self, state: list[int]) -> int:
        # 64-bit LCG per request: deterministic, cheap, never an EOS id.
        state[1] = (state[1] * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        lo = min(_MIN_TOKEN_ID, self.spec.vocab_size // 2)
        tok = lo + (state[1] >> 33) % (self.spec.vocab_size - lo)
        while tok in self.spec.eos_token_ids:
            tok = lo + (tok + 1 - lo) % (self.spec.vocab_size - lo)
        return tok

    def execute(self, plan: pb.step.StepPlan) -> tuple[pb.step.StepResult, int]:
        """One step: (result, number of tokens scheduled). Never raises."""
        result = pb.step.StepResult(step_id=plan.step_id)
        try:
            work = self._apply(plan)
        except ValueError as exc:
            log.warning("step %d rejected: %s", plan.step_id, exc)
            result.error.code = pb.common.ERROR_CODE_INVALID_ARGUMENT
            result.error.message = str(exc)
            return result, 0
        total = 0
        for rid, state, end, count in work:
            total += count
            out = result.outputs.add(request_id=rid)
            if end == state[0]:            # reached the end of the known tokens: sample one
                out.token_ids.append(self._sample(state))
                state[0] += 1
        return result, total

    def _apply(self, plan: pb.step.StepPlan) -> list[tuple[str, list[int], int, int]]:
        """Validate and apply the diff; returns (id, state, scheduled end, count) per request.
        Bad plans change nothing (checked before any state is touched)."""
        finished = set(plan.finished_ids)
        work = []
        for r in plan.new_requests:
            if not r.request_id or (r.request_id in self.requests and r.request_id not in finished):
                raise ValueError(f"new request {r.request_id!r} is empty or already running")
            end = r.num_computed_tokens + r.num_scheduled_tokens
            if r.num_scheduled_tokens < 1 or end > len(r.token_ids):
                raise ValueError(f"request {r.request_id}: scheduled up to token {end} "
                                 f"but only {len(r.token_ids)} known")
            work.append((r.request_id, [len(r.token_ids), zlib.crc32(r.request_id.encode())], end,
                         r.num_scheduled_tokens))
        for r in plan.cached_requests:
            state = None if r.request_id in finished else self.requests.get(r.request_id)
            if state is None:
                raise ValueError(f"unknown request id {r.request_id!r}")
            end = r.num_computed_tokens + r.num_scheduled_tokens
            if r.num_scheduled_tokens < 1 or end > state[0]:
                raise ValueError(f"request {r.request_id}: scheduled up to token {end} "
                                 f"but only {state[0]} known")
            work.append((r.request_id, state, end, r.num_scheduled_tokens))
        if len(self.requests) + len(plan.new_requests) - len(finished) > _MAX_REQUESTS:
            raise ValueError(f"more than {_MAX_REQUESTS} live requests")
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)   # unknown ids are fine (finished before it ran)
        for rid, state, _, _ in work[:len(plan.new_requests)]:
            self.requests[rid] = state
        return work


class SimulatedEngine:
    """The engine thread: ROUTER socket, plans in order, a sleep per step."""

    def __init__(self, cfg: WorkerConfig, sock: zmq.Socket) -> None:
        self.cfg, self.sock = cfg, sock
        spec = SimSpec.from_model_dir(cfg.model, cfg.max_model_len)
        self.runner = SimulatedRunner(spec, model_name=cfg.served_model_name,
                                      kv_cache_bytes=cfg.kv_cache_bytes, num_kv_blocks=cfg.num_kv_blocks,
                                      block_size=cfg.block_size)
        self.stop_flag = threading.Event()
        self.failed: BaseException | None = None
        self.steps = self.sampled = 0
        self.metrics = WorkerMetrics(cfg.served_model_name, cfg.engine_id)
        self.step_tracer = StepTracer() if telemetry.ENABLED else None  # the real worker's spans

    def handle(self, payload: bytes) -> pb.step.WorkerReply:
        req = pb.step.WorkerRequest()
        try:
            req.ParseFromString(payload)
        except DecodeError:
            req = pb.step.WorkerRequest()
        kind = req.WhichOneof("kind")
        if kind == "hello":
            try:
                info = self.runner.hello(req.hello.block_size)
            except ValueError as exc:
                return error_reply(str(exc))
            log.info("scheduler hello: block_size %d -> %d KV blocks (simulated)", info.block_size,
                     info.num_kv_blocks)
            return pb.step.WorkerReply(info=info)
        if kind == "plan":
            t0 = time.perf_counter()
            result, num_tokens = self.runner.execute(req.plan)
            delay = (self.cfg.simulate_step_ms + self.cfg.simulate_token_ms * num_tokens) / 1e3
            left = delay - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
            result.forward_ns = int((time.perf_counter() - t0) * 1e9)
            self.steps += 1
            num_sampled = sum(len(o.token_ids) for o in result.outputs)
            self.sampled += num_sampled
            self.metrics.on_step(result.forward_ns, num_tokens, num_sampled, result.HasField("error"))
            if self.step_tracer is not None:
                end_ns = time.time_ns()
                self.step_tracer.on_step(req.plan, result, end_ns - result.forward_ns, end_ns)
            return pb.step.WorkerReply(result=result)
        return error_reply("undecodable or empty WorkerRequest")

    def run(self, on_exit) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            last_log = time.monotonic()
            while not self.stop_flag.is_set():
                if poller.poll(_POLL_MS):
                    frames = self.sock.recv_multipart()
                    reply = self.handle(frames[-1])
                    self.sock.send_multipart([*frames[:-1], reply.SerializeToString()])
                now = time.monotonic()
                if now - last_log >= self.cfg.log_every_s and self.steps:
                    log.info("last %.0fs: %d steps, %d tokens sampled (simulated), %d requests held",
                             now - last_log, self.steps, self.sampled, len(self.runner.requests))
                    last_log, self.steps, self.sampled = now, 0, 0
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            self.failed = exc
            log.exception("simulated worker failed")
        finally:
            self.sock.close(linger=0)
            on_exit()


async def serve(cfg: WorkerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    install_stop_handlers(loop, stop)
    try:
        SimSpec.from_model_dir(cfg.model)
    except (OSError, ValueError, KeyError) as exc:
        log.error("cannot read %s/config.json: %s", cfg.model, exc)
        return 1
    # WorkerControl answers, but refuses captures: nothing here runs torch (control.py).
    control = WorkerControlServicer(refusal="the simulated worker runs no model: nothing to profile "
                                            "(start the mesh without --simulate-worker)")
    endpoints = await open_endpoints(cfg, log, control)
    if endpoints is None:
        return 1
    server, health, ctx, sock = endpoints
    engine = SimulatedEngine(cfg, sock)
    log.info("SIMULATED worker (no model): %.2f ms/step + %.3f ms/token, %d KV blocks, vocab %d",
             cfg.simulate_step_ms, cfg.simulate_token_ms, engine.runner.num_blocks,
             engine.runner.spec.vocab_size)
    thread = threading.Thread(target=engine.run, name="worker-sim", daemon=True,
                              args=(lambda: loop.call_soon_threadsafe(stop.set),))
    thread.start()
    health.set_ready(True)
    await stop.wait()
    health.set_ready(False, "stopping")
    engine.stop_flag.set()
    await asyncio.to_thread(thread.join, 10.0)
    await server.stop(1.0)
    ctx.term()
    return 1 if engine.failed is not None else 0
