"""grpc.aio adapter: meshllm.v1.Embedder over an EmbeddingEngine and a MicroBatcher.

Tokenization and validation run in a small thread pool; forward passes run in one
dedicated thread (the model is used by one batch at a time), so the event loop keeps
answering health checks and collecting the next batch meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import pb
from services.common.grpc_server import bind, make_server
from services.common.metrics import start_metrics_server
from services.embedder.batcher import MicroBatcher, QueueFull
from services.embedder.config import EmbedderConfig
from services.embedder.engine import EmbeddingEngine, InvalidInput, Item

log = logging.getLogger("meshllm.embedder.server")

SERVICE_NAME = pb.embed.DESCRIPTOR.services_by_name["Embedder"].full_name


def _items(request: "pb.embed.EmbedBatchRequest") -> list[Item]:
    items = []
    for i, item in enumerate(request.items):
        which = item.WhichOneof("input")
        if which == "text":
            items.append(Item(text=item.text))
        elif which == "token_ids":
            items.append(Item(token_ids=item.token_ids.ids))
        else:
            raise InvalidInput(f"input[{i}] has neither text nor token_ids")
    return items


class EmbedderServicer(pb.embed_grpc.EmbedderServicer):
    """Registered before the server starts; answers UNAVAILABLE until `attach()`."""

    def __init__(self, config: EmbedderConfig, executor: ThreadPoolExecutor) -> None:
        self.config, self._executor = config, executor
        self.engine: EmbeddingEngine | None = None
        self.batcher: MicroBatcher | None = None

    def attach(self, engine: EmbeddingEngine, batcher: MicroBatcher) -> None:
        self.engine, self.batcher = engine, batcher

    async def Embed(self, request, context):
        start, outcome, tokens = time.perf_counter(), "ok", 0
        cfg = self.config
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the embedding model is loading")
        try:
            n = len(request.items)
            if n == 0:
                raise InvalidInput("the request has no inputs")
            if n > cfg.max_items_per_request:
                raise InvalidInput(f"too many inputs: {n} > {cfg.max_items_per_request}")
            chars = sum(len(it.text) for it in request.items)
            if chars > cfg.max_request_chars:
                raise InvalidInput(f"inputs too long in total: {chars} characters > "
                                   f"{cfg.max_request_chars}")
            items = _items(request)
            truncate = (request.truncate_prompt_tokens
                        if request.HasField("truncate_prompt_tokens") else None)
            # `tokenizers` releases the GIL while encoding: this really runs beside the loop.
            seqs = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.prepare, items, truncate)
            tokens = sum(map(len, seqs))
            vectors = await self.batcher.embed(seqs)          # [n, dims] float32
        except InvalidInput as exc:
            outcome = "invalid"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            outcome = "overloaded"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            log.info("embed id=%s items=%d tokens=%d outcome=%s ms=%.1f",
                     request.request_id or "-", len(request.items), tokens, outcome,
                     (time.perf_counter() - start) * 1e3)
        return pb.embed.EmbedBatchResponse(embeddings=[
            pb.embed.EmbedVector(values=vec, num_tokens=len(seq))
            for vec, seq in zip(vectors.tolist(), seqs)])

    async def GetInfo(self, request, context):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the embedding model is loading")
        return pb.embed.EmbedderInfo(
            model_name=self.config.served_model_name, dimensions=self.engine.dimensions,
            max_model_len=self.engine.max_model_len, vocab_size=self.engine.vocab_size,
            max_items_per_request=self.config.max_items_per_request)


def build_engine(config: EmbedderConfig) -> EmbeddingEngine:
    import torch
    torch.set_num_threads(config.threads)
    return EmbeddingEngine(config.model, device=config.device, dtype=config.torch_dtype,
                           max_model_len=config.max_model_len,
                           max_batch_tokens=config.max_batch_tokens)


async def serve(config: EmbedderConfig, stop: asyncio.Event) -> int:
    """Load the model, serve until `stop` is set, then shut down gracefully."""
    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="embed-model")
    prep_threads = ThreadPoolExecutor(2, thread_name_prefix="embed-prep")
    server, health = make_server("embedder", [SERVICE_NAME])
    servicer = EmbedderServicer(config, prep_threads)
    pb.embed_grpc.add_EmbedderServicer_to_server(servicer, server)
    port = bind(server, config.address, config.internal_tls.server_credentials())
    await server.start()   # health answers NOT_SERVING while the model loads
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"embedder listening on {host}:{port}", flush=True)
    metrics_port = start_metrics_server(config.host, config.metrics_port)
    if metrics_port:
        print(f"embedder metrics on http://{host}:{metrics_port}/metrics", flush=True)
    batcher = None
    try:
        engine = await loop.run_in_executor(model_thread, build_engine, config)
        batcher = MicroBatcher(engine.embed, model_thread, max_batch_items=config.max_batch_items,
                               max_wait_s=config.batch_wait_ms / 1e3,
                               max_queued_items=config.max_queued_items)
        batcher.start()
        servicer.attach(engine, batcher)
        log.info("loaded %s as %r: dims=%d max_model_len=%d vocab=%d pooling=%s on %s/%s in %.2f s",
                 config.model, config.served_model_name, engine.dimensions, engine.max_model_len,
                 engine.vocab_size, engine.model.cfg.pooling, config.device, config.torch_dtype,
                 time.perf_counter() - started)
        health.set_ready(True)
        await stop.wait()
        health.set_ready(False, "stopping")
        await server.stop(grace=2.0)
        log.info("stopped")
    finally:
        if batcher is not None:
            await batcher.close()
        await server.stop(grace=None)
        model_thread.shutdown(wait=False, cancel_futures=True)
        prep_threads.shutdown(wait=False, cancel_futures=True)
    return 0
