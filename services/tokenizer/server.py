"""grpc.aio adapter: meshllm.v1.Tokenizer over a TokenizerCore.

Encoding big batches and rendering chat templates run in a small thread pool so the
event loop keeps answering health checks and Detokenize streams meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import pb, telemetry
from services.common.grpc_server import ServiceHealth, bind, make_server
from services.common.metrics import start_metrics_server
from services.tokenizer.chat_template import ChatTemplateError, MessageLimits, RenderLimits
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.core import TokenizerCore
from services.tokenizer.detokenizer import DetokenizerFullError, IncrementalDetokenizer
from services.tokenizer.tracing import DetokenizeSpans
from services.tokenizer.template_inputs import (parse_template_kwargs, parse_tools,
                                                tool_calls_for_template)

log = logging.getLogger("meshllm.tokenizer.server")

SERVICE_NAME = pb.tokenizer.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Below this many chars a batch encodes in well under a millisecond: a thread hop costs more.
_INLINE_ENCODE_CHARS = 16_384


class TokenizerServicer(pb.tokenizer_grpc.TokenizerServicer):
    def __init__(self, core: TokenizerCore, config: TokenizerConfig,
                 executor: ThreadPoolExecutor) -> None:
        self._core = core
        self._config = config
        self._executor = executor

    async def Encode(self, request, context):
        start = time.perf_counter()
        texts = list(request.texts)
        cfg = self._config
        if len(texts) > cfg.max_batch_texts:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"too many texts: {len(texts)} > {cfg.max_batch_texts}")
        longest = max(map(len, texts), default=0)
        if longest > cfg.max_text_chars:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"text too long: {longest} chars > {cfg.max_text_chars}")
        total = sum(map(len, texts))
        if total > cfg.max_total_chars:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"texts too long in total: {total} chars > {cfg.max_total_chars}")
        results = await self._encode(texts, request.add_special_tokens, total)
        if telemetry.ENABLED:  # the span opened by grpc_tracing; counts only, never text
            telemetry.annotate({"meshllm.texts": len(texts), "meshllm.chars": total,
                                "meshllm.tokens": sum(map(len, results))})
        log.info("encode texts=%d chars=%d tokens=%d add_special=%s ms=%.1f", len(texts), total,
                 sum(map(len, results)), request.add_special_tokens,
                 (time.perf_counter() - start) * 1e3)
        return pb.tokenizer.EncodeResponse(results=[pb.common.TokenIds(ids=ids) for ids in results])

    async def ApplyChatTemplate(self, request, context):
        start = time.perf_counter()
        try:
            messages = [_message_dict(m, i) for i, m in enumerate(request.messages)]
            tools = parse_tools(request.tools_json)
            extra = parse_template_kwargs(request.chat_template_kwargs_json)
            text = await asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: self._core.apply_chat_template(
                    messages, add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    tools=tools, extra=extra))
        except ChatTemplateError as e:
            # The error text may quote the messages: log its class only.
            log.info("chat_template messages=%d rejected=%s", len(request.messages),
                     type(e).__name__)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids: list[int] = []
        if request.tokenize:
            # The template already wrote the special tokens (bos, headers) it wants.
            ids = (await self._encode([text], False, len(text)))[0]
        if telemetry.ENABLED:
            telemetry.annotate({"meshllm.messages": len(messages), "meshllm.chars": len(text),
                                "meshllm.tokens": len(ids)})
        log.info("chat_template messages=%d chars=%d tokens=%d ms=%.1f", len(messages), len(text),
                 len(ids), (time.perf_counter() - start) * 1e3)
        return pb.tokenizer.ChatTemplateResponse(text=text, token_ids=ids)

    async def Detokenize(self, request_iterator, context):
        # Per-stream state: it dies with the stream even if items never said finished.
        detok = IncrementalDetokenizer(self._core.decode, self._config.max_detokenize_requests)
        spans = DetokenizeSpans(self._config.max_detokenize_requests) if telemetry.ENABLED else None
        messages = items = 0
        try:
            async for request in request_iterator:
                messages += 1
                items += len(request.items)
                outputs = []
                for item in request.items:
                    error = _bad_item(item)
                    if error:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
                    if spans is not None:
                        spans.on_item(item)
                    try:
                        delta = detok.step(item.request_id, item.new_token_ids,
                                           prefix_token_ids=item.prefix_token_ids,
                                           skip_special_tokens=item.skip_special_tokens,
                                           finished=item.finished)
                    except DetokenizerFullError as e:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                    out = pb.tokenizer.DetokenizeOutput(request_id=item.request_id,
                                                        text_delta=delta)
                    if item.token_string_ids:
                        out.token_strings.update(self._core.token_strings(item.token_string_ids))
                    outputs.append(out)
                log.debug("detokenize message items=%d live=%d", len(request.items), len(detok))
                yield pb.tokenizer.DetokenizeResponse(outputs=outputs)
        finally:
            log.info("detokenize stream closed messages=%d items=%d unfinished=%d",
                     messages, items, len(detok))
            detok.clear()
            if spans is not None:
                spans.clear()

    async def Decode(self, request, context):
        cfg = self._config
        if len(request.sequences) > cfg.max_batch_texts:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"too many sequences: {len(request.sequences)} > {cfg.max_batch_texts}")
        vocab = self._core.vocab_size
        for seq in request.sequences:
            if any(not 0 <= i < vocab for i in seq.ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"token ids must be in [0, {vocab})")
        texts = [self._core.decode(seq.ids, request.skip_special_tokens)
                 for seq in request.sequences]
        log.info("decode sequences=%d tokens=%d", len(texts),
                 sum(len(s.ids) for s in request.sequences))
        return pb.tokenizer.DecodeResponse(texts=texts)

    async def ConvertIdsToTokens(self, request, context):
        # One id per token of a prompt: bounded like the chars of one Encode call.
        if len(request.ids) > self._config.max_total_chars:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"too many ids: {len(request.ids)} > {self._config.max_total_chars}")
        vocab = self._core.vocab_size
        if any(not 0 <= i < vocab for i in request.ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, {vocab})")
        return pb.tokenizer.IdsToTokensResponse(tokens=self._core.ids_to_tokens(request.ids))

    async def GetConfig(self, request, context):
        cls, template, config = self._core.tokenizer_config()
        return pb.tokenizer.TokenizerConfig(tokenizer_class=cls, chat_template=template,
                                            config_json=json.dumps(config, ensure_ascii=False))

    async def GetInfo(self, request, context):
        info = self._core.info()
        return pb.tokenizer.TokenizerInfo(
            vocab_size=info.vocab_size, bos_token_id=info.bos_token_id,
            eos_token_ids=list(info.eos_token_ids), has_chat_template=info.has_chat_template,
            model_max_length=info.model_max_length)

    async def _encode(self, texts: list[str], add_special_tokens: bool, chars: int) -> list[list[int]]:
        if chars <= _INLINE_ENCODE_CHARS:
            return self._core.encode_batch(texts, add_special_tokens)
        # `tokenizers` releases the GIL while encoding, so this really runs beside the loop.
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._core.encode_batch, texts, add_special_tokens)


def _message_dict(message, index: int) -> dict:
    out = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls_json:
        out["tool_calls"] = tool_calls_for_template(message.tool_calls_json, index)
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _bad_item(item) -> str:
    if not item.request_id:
        return "detokenize item without request_id"
    if any(i < 0 for i in item.new_token_ids) or any(i < 0 for i in item.prefix_token_ids):
        return f"negative token id for request {item.request_id}"
    return ""


def build_server(core: TokenizerCore, config: TokenizerConfig,
                 executor: ThreadPoolExecutor) -> tuple[grpc.aio.Server, ServiceHealth, int]:
    """A bound (not started) server; returns (server, health, port)."""
    server, health = make_server("tokenizer", [SERVICE_NAME])
    pb.tokenizer_grpc.add_TokenizerServicer_to_server(
        TokenizerServicer(core, config, executor), server)
    port = bind(server, config.address, config.internal_tls.server_credentials())
    return server, health, port


async def serve(config: TokenizerConfig, stop: asyncio.Event) -> int:
    """Load the model dir, serve until `stop` is set, then shut down gracefully."""
    core = load_core(config)
    info = core.info()
    log.info("loaded %s vocab=%d bos=%d eos=%s chat_template=%s max_len=%d", config.model,
             info.vocab_size, info.bos_token_id, list(info.eos_token_ids), info.has_chat_template,
             info.model_max_length)
    executor = ThreadPoolExecutor(config.worker_threads, thread_name_prefix="tokenizer")
    try:
        server, health, port = build_server(core, config, executor)
        await server.start()
        health.set_ready(True)
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(f"tokenizer listening on {host}:{port}", flush=True)
        metrics_port = start_metrics_server(config.host, config.metrics_port)
        if metrics_port:
            print(f"tokenizer metrics on http://{host}:{metrics_port}/metrics", flush=True)
        await stop.wait()
        health.set_ready(False, "stopping")
        await server.stop(grace=2.0)
        log.info("stopped")
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
    return 0


def load_core(config: TokenizerConfig) -> TokenizerCore:
    """The model dir's tokenizer with the config's chat-template limits (raises TokenizerLoadError)."""
    return TokenizerCore.from_dir(
        config.model, chat_template_path=config.chat_template,
        render_limits=RenderLimits(max_chars=config.max_template_chars,
                                   max_render_s=config.max_render_s),
        message_limits=MessageLimits(max_messages=config.max_chat_messages,
                                     max_chars=config.max_template_chars))
