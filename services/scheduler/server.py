"""The scheduler's I/O adapter: EngineStream (gRPC) to gateways, StepPlan/StepResult (ZMQ) to the worker.

One engine loop task drives the pure core: apply queued submits/aborts, schedule, send the
plan, await the result, update, and send each stream one OutputBatch for the step."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc

from services.common import pb, telemetry
from services.scheduler import wire
from services.scheduler.abort_tracker import AbortTracker
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.health import EngineVitals
from services.scheduler.core import FinishReason, RequestOutput, Scheduler, SchedulerConfig
from services.scheduler.metrics import ENGINE_STATE, EngineMetrics, RequestRecord
from services.scheduler.tracing import RequestTraces
from services.scheduler.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger("meshllm.scheduler")

RESET_TIMEOUT_S = 10.0   # ResetPrefixCache waits at most this long for a step boundary


@dataclass
class _Stream:
    """One gateway connection: its outgoing queue and the requests it owns.

    The queue holds (step id, outputs) pairs, and None once the gateway closed its side."""

    queue: asyncio.Queue
    request_ids: set[str]


class Engine:
    def __init__(self, config: SchedulerServiceConfig, worker: WorkerClient, health) -> None:
        self.config = config
        self.worker = worker
        self.health = health
        self.served_model_name = config.served_model_name
        self.core: Scheduler | None = None
        self.info: pb.step.WorkerInfo | None = None
        self._streams: dict[int, _Stream] = {}
        self._owner: dict[str, int] = {}          # request id -> stream key
        self._live: dict[str, RequestRecord] = {}  # request id -> its timestamps (metrics, timing, log line)
        self.metrics: EngineMetrics | None = None   # built once the model name is known
        self._inbox: list[tuple[int, pb.engine.EngineRequest]] = []
        self._wake = asyncio.Event()
        self._flushes: list[asyncio.Future] = []   # ResetPrefixCache calls waiting for a step boundary
        self._stopping = False
        self.vitals = EngineVitals(config.progress_timeout_s)  # read by the health thread
        self.traces = RequestTraces() if telemetry.ENABLED else None  # None: tracing off
        self.steps = 0
        self.aborts = AbortTracker(config.engine_id, 2 if config.async_scheduling else 1)
        # Tier 2 (docs/kv_tiers.md): lookups go to the kvstore on threads, never on this loop.
        self.kv = None
        if config.kvstore_addr:
            from services.common.kv_client import KvClient
            self.kv = KvClient(config.kvstore_addr, credentials=config.internal_tls.channel_credentials(),
                               use_shm=False, copy_threads=1)
        self._kv_threads = ThreadPoolExecutor(4, thread_name_prefix="kv-lookup") if self.kv is not None else None
        self._lookups_done: list[tuple[str, int, int, int]] = []   # (request id, found, start ns, end ns)
        self._loads_started: dict[str, int] = {}                   # request id -> when its fetch was planned
        self._leases: dict[str, float] = {}     # direct hand-offs held here: request id -> monotonic start
        self.leases_expired = 0

    # ---- worker link ------------------------------------------------------------------------
    async def connect_worker(self) -> None:
        """Say hello until the worker answers, then build the core over its KV capacity."""
        while not self._stopping:
            try:
                info = await self.worker.hello(self.config.block_size)
            except WorkerUnavailable as exc:
                log.info("waiting for worker: %s", exc)
                await asyncio.sleep(0.5)
                continue
            max_len = min(self.config.max_model_len or info.max_model_len, info.max_model_len)
            cfg = SchedulerConfig(max_model_len=max_len, max_num_seqs=self.config.max_num_seqs,
                                  max_num_batched_tokens=self.config.max_num_batched_tokens,
                                  block_size=self.config.block_size, max_waiting=self.config.max_waiting,
                                  policy=self.config.scheduling_policy,
                                  enable_prefix_caching=self.config.enable_prefix_caching,
                                  num_spec_tokens=self.config.num_spec_tokens,
                                  kv_load_failure_policy=self.config.kv_load_failure_policy)
            self.info = info
            tier = self.kv is not None and info.HasField("kv_namespace")
            cfg.kv_tier = tier and cfg.enable_prefix_caching
            if self.kv is not None and not tier:
                log.warning("--kvstore-addr is set but the worker does not use the kvstore: tier 2 off")
            if self.metrics is None:
                model_name = self.served_model_name or info.model_name
                self.metrics = EngineMetrics(model_name, self.config.engine_id)
                ENGINE_STATE.engines[(model_name, self.config.engine_id)] = self
            self.core = Scheduler(cfg, info.num_kv_blocks, frozenset(info.eos_token_ids), info.vocab_size,
                                  num_host_blocks=info.num_host_kv_blocks, export_addr=info.kv_export_addr)
            self._loads_started.clear()
            self._leases.clear()
            self.health.set_ready(True)
            self.vitals.set_worker(True, "ready")
            log.info("worker ready: %d KV blocks of %d tokens, max_model_len %d, device %s",
                     info.num_kv_blocks, info.block_size, max_len, info.device)
            return

    # ---- streams ------------------------------------------------------------------------
    def open_stream(self) -> tuple[int, _Stream]:
        key = id(object()) ^ time.monotonic_ns()
        stream = _Stream(asyncio.Queue(), set())
        self._streams[key] = stream
        return key, stream

    def close_stream(self, key: int) -> None:
        stream = self._streams.pop(key, None)
        if stream and stream.request_ids:
            # The gateway went away: nobody will read these outputs.
            if self.core is not None:
                self.aborts.on_abort(stream.request_ids, self.core.requests)
            self._inbox.append((key, pb.engine.EngineRequest(abort=pb.engine.AbortBatch(
                request_ids=list(stream.request_ids)))))
            self._wake.set()

    def submit(self, key: int, msg: pb.engine.EngineRequest) -> None:
        if self.core is not None and msg.HasField("abort"):
            self.aborts.on_abort(msg.abort.request_ids, self.core.requests)
        self._inbox.append((key, msg))
        self.vitals.note_pending(True)
        self._wake.set()

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for key, msg in inbox:
            if msg.HasField("submit"):
                for sub in msg.submit.requests:
                    stream = self._streams.get(key)
                    if stream is None:
                        continue
                    if self.vitals.draining:
                        # Shutting down: refuse at once (the gateway may retry it elsewhere).
                        stream.queue.put_nowait((self.steps, [RequestOutput(
                            sub.request_id, [], FinishReason.ERROR, "unavailable", "the engine is shutting down",
                            num_prompt_tokens=len(sub.prompt_token_ids))]))
                        continue
                    self._owner[sub.request_id] = key
                    self._live[sub.request_id] = self.metrics.on_submit(
                        sub.trace.traceparent if sub.HasField("trace") else "")
                    stream.request_ids.add(sub.request_id)
                    request = wire.request_from_submit(sub)
                    if self.traces is not None and request.trace is not None:
                        self.traces.on_submit(request)  # the worker's parent becomes our span
                    self.core.add_request(request)
            elif msg.HasField("abort"):
                self.core.abort([rid for rid in msg.abort.request_ids if rid in self.core.requests])
        if self.kv is not None:
            self._kv_lookups()

    def _expire_leases(self) -> None:
        """Direct hand-offs the decode side never released within --kv-lease-s: free their blocks."""
        now, core = time.time_ns(), self.core
        for rid, deadline in list(self._leases.items()):
            if rid not in core.leases:
                del self._leases[rid]   # released (or failed) already
            elif now >= deadline:
                del self._leases[rid]
                core.abort([rid])
                self.leases_expired += 1
                log.warning("request %s: hand-off lease expired after %.0fs; its blocks are freed",
                            rid, self.config.kv_lease_s)

    # ---- tier 2 -------------------------------------------------------------------------
    def _kv_lookups(self) -> None:
        """Send the core's kvstore lookups to threads and hand their answers back to it."""
        core = self.core
        if self._lookups_done:
            done, self._lookups_done = self._lookups_done, []
            for rid, found, t0, t1 in done:
                core.on_tier_lookup(rid, found)
                if self.traces:
                    self.traces.on_tier(rid, "kv.lookup", t0, t1, {"meshllm.kv.blocks_found": found})
        lookups = core.take_lookups()
        if not lookups:
            return
        ns, loop = self.info.kv_namespace, asyncio.get_running_loop()

        def lookup(rid: str, hashes: list[bytes]) -> None:
            t0 = time.time_ns()
            found = self.kv.lookup(ns, hashes)   # 0 when the store is down or slow (its own deadline)
            self._lookups_done.append((rid, found, t0, time.time_ns()))
            loop.call_soon_threadsafe(self._wake.set)
        for rid, hashes in lookups:
            self._kv_threads.submit(lookup, rid, hashes)

    def _trace_tier(self, plan, result, sent_ns: int) -> None:
        """kv.load spans (planned -> reported) and kv.save spans (the step that copied the blocks
        out, sent -> result; the put itself runs in the worker's background) of traced requests."""
        now = time.time_ns()
        for t in plan.tier_loads:
            self._loads_started[t.request_id] = now
        for r in result.kv_loads:
            start = self._loads_started.pop(r.request_id, now)
            self.traces.on_tier(r.request_id, "kv.load", start, now, {
                "meshllm.kv.blocks_requested": r.num_requested, "meshllm.kv.blocks_loaded": r.num_loaded,
                "meshllm.kv.bytes": r.bytes, "meshllm.kv.fetch_ms": r.duration_ns / 1e6})
        for t in plan.tier_saves:
            self.traces.on_tier(t.request_id, "kv.save", sent_ns, now, {"meshllm.kv.blocks": len(t.block_ids)})

    def _dispatch(self, step_id: int, outputs: list[RequestOutput]) -> None:
        per_stream: dict[int, list[RequestOutput]] = {}
        metrics, now, generated = self.metrics, time.monotonic_ns(), 0
        for out in outputs:
            if out.handoff_peer:   # a direct hand-off: its blocks are held here until released or expired
                out.handoff_deadline_ns = time.time_ns() + int(self.config.kv_lease_s * 1e9)
                self._leases[out.request_id] = out.handoff_deadline_ns
                asyncio.get_running_loop().call_later(self.config.kv_lease_s + 0.05, self._wake.set)
            key = self._owner.get(out.request_id)
            live = self._live.get(out.request_id)
            n = len(out.new_token_ids)
            if live is not None and n:
                generated += n
                if not live.num_output_tokens:
                    metrics.on_first_token(live, out.num_prompt_tokens, now)
                    out.timing = metrics.stamps(live)
                live.num_output_tokens += n
            if out.finish_reason is not None:
                self._owner.pop(out.request_id, None)
                live = self._live.pop(out.request_id, None)
                if live is not None:
                    out.timing = metrics.on_finished(live, out.finish_reason, out.num_prompt_tokens, now)
                self._log_finished(out, live, now)
                if self.traces:  # None when tracing is off; empty when no request is traced
                    self.traces.on_finished(out, live.num_output_tokens if live is not None else 0)
                stream = self._streams.get(key)
                if stream is not None:
                    stream.request_ids.discard(out.request_id)
            if key in self._streams:
                per_stream.setdefault(key, []).append(out)
        if generated:
            metrics.generation_tokens.inc(generated)  # once per step, not per token
        for key, outs in per_stream.items():
            self._streams[key].queue.put_nowait((step_id, outs))

    @staticmethod
    def _log_finished(out: RequestOutput, live: RequestRecord | None, now_ns: int) -> None:
        """One line per request: counts and timing, never token ids or text."""
        arrived = live.queued_ns if live is not None else now_ns
        n_out = live.num_output_tokens if live is not None else len(out.new_token_ids)
        log.info("request %s finished reason=%s prompt_tokens=%d output_tokens=%d e2e_ms=%.0f%s",
                 out.request_id, out.finish_reason, out.num_prompt_tokens, n_out,
                 (now_ns - arrived) / 1e6, f" error={out.error_code}" if out.error_code else "")

    def _mark_scheduled(self, plan) -> None:
        """Queue time ends when a request first enters a step (new_requests: only requests
        the worker holds no state for, so this loop does not grow with the running batch)."""
        now = time.monotonic_ns()
        for r in plan.new_requests:
            rec = self._live.get(r.request_id)
            if rec is not None and not rec.scheduled_ns:
                self.metrics.on_scheduled(rec, now)

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        """Plan, send, collect. With async scheduling two plans are in flight: step N+1 is
        planned and queued at the worker while step N runs, so CPU work hides behind it."""
        await self.connect_worker()
        depth = 2 if self.config.async_scheduling else 1
        inflight: deque = deque()
        last_result = 0.0   # when the previous step's result arrived (step duration)
        while not self._stopping:
            self._drain_inbox()
            self._run_flushes()
            if self._leases:
                self._expire_leases()
            self.vitals.note_pending(bool(inflight) or self.core.has_work())
            if len(inflight) < depth and self.core.has_work():
                plan = self.core.schedule()
                # While kvstore fetches are under way an empty plan still goes: its result says
                # which ended (the worker waits a few ms for one), so this loop never sleeps on them.
                if not plan.is_empty() or ((self.core.loading or self.core.handoffs) and not inflight):
                    if plan.new_requests:
                        self._mark_scheduled(plan)
                    await self.worker.send_plan(wire.plan_to_proto(plan))
                    self.aborts.on_plan(plan.step_id)
                    inflight.append((plan, time.perf_counter()))
                    if len(inflight) < depth:
                        continue  # plan the next step before waiting for this one
                else:
                    self._dispatch(plan.step_id, self.core.take_pending_outputs())
            if inflight:
                plan, t0 = inflight.popleft()
                try:
                    result = await self.worker.recv_result()
                except WorkerUnavailable as exc:
                    log.error("worker lost: %s", exc)
                    inflight.clear()
                    self.health.set_ready(False, str(exc))
                    self.vitals.set_worker(False, f"worker lost: {exc}")
                    self._dispatch(plan.step_id, self.core.fail_all("unavailable", f"engine unavailable: {exc}"))
                    await self.connect_worker()
                    continue
                self.aborts.on_result(plan.step_id, result.outputs)
                core_result = wire.result_from_proto(result)
                if self.traces and (plan.tier_loads or plan.tier_saves or core_result.kv_loads):
                    self._trace_tier(plan, core_result, time.time_ns() - int((time.perf_counter() - t0) * 1e9))
                outputs = self.core.update(plan, core_result)
                self.steps += 1
                self.vitals.step_done()
                self._dispatch(plan.step_id, outputs)
                # With two plans in flight a step starts when the previous result is in, not
                # when it was sent: count only the time it really held the pipeline.
                now = time.perf_counter()
                num_reqs = len(plan.new_requests) + len(plan.cached_requests)
                num_tokens = plan.num_scheduled_tokens
                self.metrics.on_step(now - max(t0, last_result), num_reqs, num_tokens)
                last_result = now
                log.debug("step %d: %d reqs, %d tokens, %.1f ms", plan.step_id, num_reqs, num_tokens,
                          (now - t0) * 1e3)
                continue
            if not self._inbox and not self._flushes:
                # Idle, or nothing fits until something changes: wait for a submit or abort.
                self._wake.clear()
                await self._wake.wait()

    async def reset_prefix_cache(self, tiers: bool = False) -> tuple[int, int, int]:
        """Flush the prefix cache of unused blocks at the loop's next step boundary, so it
        never interleaves with schedule()/update(); with `tiers` also tier 1's index and this
        engine's namespaces in the kvstore (one per tensor-parallel rank). Returns (flushed, still
        cached, kvstore blocks flushed over every rank: -1 when there is no kvstore or it did not
        answer)."""
        done = asyncio.get_running_loop().create_future()
        # Calls that timed out while the loop was stuck leave cancelled futures: drop them.
        self._flushes = [f for f in self._flushes if not f.done()]
        self._flushes.append((done, tiers))
        self._wake.set()
        flushed, cached = await done
        kv_flushed = -1
        if tiers and self.kv is not None and self.info is not None and self.info.HasField("kv_namespace"):
            n = await asyncio.get_running_loop().run_in_executor(self._kv_threads, self._flush_ranks,
                                                                 self.info.kv_namespace)
            kv_flushed = -1 if n is None else n
        return flushed, cached, kv_flushed

    def _flush_ranks(self, ns) -> int | None:
        """The worker reports rank 0's namespace; rank r's differs only in tp_rank (its shard has
        the same bytes per block: the heads split evenly)."""
        total = 0
        for rank in range(max(1, ns.tp_size)):
            rank_ns = type(ns)()
            rank_ns.CopyFrom(ns)
            rank_ns.tp_rank = rank
            n = self.kv.flush(rank_ns)
            if n is None:
                return None
            total += n
        return total

    def _run_flushes(self) -> None:
        if not self._flushes:
            return
        waiting, self._flushes = self._flushes, []
        flushed = self.core.reset_prefix_cache(tiers=any(t for _, t in waiting))
        log.info("prefix cache reset: %d free blocks flushed, %d held blocks keep theirs",
                 flushed, self.core.pool.num_cached)
        for done, _ in waiting:  # calls that arrived together share one flush
            if not done.done():
                done.set_result((flushed, self.core.pool.num_cached))

    def begin_drain(self) -> None:
        """SIGTERM: readiness goes false and new submits are refused; in-flight ones go on."""
        self.vitals.draining = True
        self.health.set_ready(False, "shutting down")

    def busy(self) -> bool:
        return self.core is not None and (self.core.has_work() or bool(self._inbox))

    def fail_remaining(self, message: str) -> None:
        """End what the grace period did not finish with a clear error, not silence."""
        if self.core is not None:
            self._dispatch(self.steps, self.core.fail_all("unavailable", message))

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self.traces is not None:
            self.traces.close_all()


def merge_steps(steps: list[list[RequestOutput]]) -> list[RequestOutput]:
    """Consecutive steps' outputs as one step: one output per request, its tokens and
    logprobs in order, the last one's finish (nothing follows a finish)."""
    merged: dict[str, RequestOutput] = {}
    copied: set[str] = set()
    earlier: list[RequestOutput] = []   # finished requests whose id came back (kept apart)
    for outs in steps:
        for o in outs:
            rid = o.request_id
            m = merged.get(rid)
            if m is None or m.finish_reason is not None:
                if m is not None:
                    earlier.append(m)
                    copied.discard(rid)
                merged[rid] = o
                continue
            if rid not in copied:  # extend a copy: the core's outputs stay as they were
                copied.add(rid)
                m = merged[rid] = replace(m, new_token_ids=list(m.new_token_ids),
                                          logprobs=list(m.logprobs))
            m.new_token_ids += o.new_token_ids
            m.logprobs += o.logprobs
            if o.prompt_logprobs:   # only the first-token output has them: nothing to copy first
                m.prompt_logprobs = [*m.prompt_logprobs, *o.prompt_logprobs]
            m.finish_reason, m.error_code, m.error_message = o.finish_reason, o.error_code, o.error_message
            if o.timing is not None:
                m.timing = o.timing
            m.num_cached_tokens = max(m.num_cached_tokens, o.num_cached_tokens)
            m.num_prompt_tokens, m.stop_token_id = o.num_prompt_tokens, o.stop_token_id
    return earlier + list(merged.values())


class EngineServicer(pb.engine_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def EngineStream(self, request_iterator, context):
        engine = self.engine
        if engine.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not ready")
        key, stream = engine.open_stream()

        async def pump() -> None:
            try:
                async for msg in request_iterator:
                    engine.submit(key, msg)
            finally:
                stream.queue.put_nowait(None)  # the gateway closed its side

        reader = asyncio.create_task(pump())
        try:
            while (item := await stream.queue.get()) is not None:
                step_id, outs = item
                # Steps that queued up while the gateway was slow to read go out as one
                # message: it reads one message at a time, so this is what lets it catch up.
                if not stream.queue.empty():
                    steps = [outs]
                    while not stream.queue.empty():
                        item = stream.queue.get_nowait()
                        if item is None:
                            return
                        step_id = item[0]
                        steps.append(item[1])
                    outs = merge_steps(steps)
                yield wire.outputs_to_proto(step_id, outs)
        finally:
            reader.cancel()
            engine.close_stream(key)

    async def GetEngineInfo(self, request, context):
        engine = self.engine
        if engine.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not ready")
        cfg = engine.core.config
        return pb.engine.EngineInfo(model_name=engine.served_model_name or engine.info.model_name,
                                    max_model_len=cfg.max_model_len, vocab_size=engine.info.vocab_size,
                                    block_size=cfg.block_size, num_kv_blocks=engine.core.pool.num_blocks,
                                    max_num_seqs=cfg.max_num_seqs,
                                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                                    eos_token_ids=list(engine.info.eos_token_ids), kv_role=engine.config.kv_role)

    async def ResetPrefixCache(self, request, context):
        if self.engine.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not ready")
        try:
            flushed, cached, kv_flushed = await asyncio.wait_for(
                self.engine.reset_prefix_cache(tiers=request.tiers), RESET_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine loop reached no step boundary "
                                f"within {RESET_TIMEOUT_S:.0f}s (worker lost or a step is stuck)")
        return pb.engine.ResetPrefixCacheResponse(num_blocks_flushed=flushed, num_blocks_cached=cached,
                                                  num_tier_blocks_flushed=kv_flushed)

    async def GetLoad(self, request, context):
        core = self.engine.core
        if core is None:
            return pb.engine.LoadInfo()
        st = core.stats()
        return pb.engine.LoadInfo(num_running=core.num_running, num_waiting=core.num_waiting,
                                  kv_usage=core.pool.usage, steps=self.engine.steps,
                                  prefix_cache_queries=st["prefix_cache_queries"],
                                  prefix_cache_hits=st["prefix_cache_hits"], num_preemptions=core.num_preemptions,
                                  aborts=self.engine.aborts.aborts,
                                  tokens_after_abort=self.engine.aborts.tokens_after_abort)
