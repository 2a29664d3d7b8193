"""The public gRPC API: meshllm.v1.Generation (Generate, Tokenize, ListModels, Abort)."""
from __future__ import annotations

import logging
import time

import grpc

from services.common import finish, pb, telemetry
from services.common.sampling_rules import RequestOptions
from services.gateway.clients.engine_pool import reset_prefix_caches
from services.gateway.openai.chat_input import check_chat_input
from services.gateway.openai.choices import ChoiceGroup
from services.gateway.openai.truncation import check_truncation, truncate_prompt
from services.gateway.embeddings import grpc_embed
from services.gateway.errors import ApiError
from services.gateway.guard.auth import ApiKeys
from services.gateway.ids import new_request_id, sane_client_id
from services.gateway.service import Gateway
from services.gateway.timing import RequestTimer
from services.gateway.timing import track as track_timing
from services.gateway.tracing import end_grpc_request_span, start_grpc_request_span

log = logging.getLogger("meshllm.gateway.grpc")

SERVICE_NAME = "meshllm.v1.Generation"


def _chat_args(chat: "pb.generation.ChatInput") -> tuple[bool, bool]:
    add = (chat.add_generation_prompt if chat.HasField("add_generation_prompt")
           else not chat.continue_final_message)
    if add and chat.continue_final_message:
        raise ApiError("invalid_argument", "add_generation_prompt and continue_final_message "
                       "cannot both be true", param="chat")
    return add, chat.continue_final_message


async def _tokenize_chat(gw: Gateway, chat: "pb.generation.ChatInput", *,
                         render_only: bool = False) -> list[int]:
    add, cont = _chat_args(chat)
    check_chat_input(chat, gw.config.tool_call_parser, render_only=render_only)
    return await gw.tokenize_chat(chat.messages, add, cont, tools_json=chat.tools_json,
                                  chat_template_kwargs_json=chat.chat_template_kwargs_json)


class GenerationServicer(pb.generation_grpc.GenerationServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.started = int(time.time())
        # Requests started through this API (the only ones its Abort may touch), with the owner
        # that started them; bounded by the engine client's in-flight limit, cleaned when each
        # stream ends.
        self._active: dict[str, tuple[ChoiceGroup, str]] = {}
        self._keys = ApiKeys(gw.config.api_keys, gw.config.admin_api_keys)

    def _caller(self, context) -> tuple[str, bool]:
        """(owner, is_admin) from the call's `authorization` metadata (guard/auth.py)."""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                return self._keys.principal(value)
        return self._keys.principal(None)

    async def _prompt_ids(self, request: "pb.generation.GenerateRequest") -> list[int]:
        which = request.WhichOneof("input")
        if which == "text":
            return await self.gw.tokenize_text(request.text)
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "chat":
            return await _tokenize_chat(self.gw, request.chat)
        raise ApiError("invalid_argument", "input must be one of text, token_ids or chat")

    async def Generate(self, request, context):
        start, handle, outcome = time.monotonic(), None, "ok"
        timer = RequestTimer() if request.return_timing else None
        rid = request.request_id or new_request_id("gen")
        # The request's root span, current while it runs (tokenizer and engine calls carry it).
        span = start_grpc_request_span("Generate", context, sane_client_id(rid) or "")
        token = telemetry.attach(span)
        try:
            if sane_client_id(rid) is None:
                raise ApiError("invalid_argument", "request_id must be 1-128 characters of "
                               "[A-Za-z0-9._:@/+=-]")
            self.gw.check_model(request.model)
            sampling = request.sampling  # read only: start_n sends the rulebook's copy
            n = request.n or 1  # proto3: 0 = unset = one choice
            # The HTTP API's rules, before any tokenizer work (start_n trusts they passed).
            await self.gw.check_sampling(sampling, RequestOptions(
                n=n, cache_salt=request.cache_salt, priority=request.priority))
            keep = (request.truncate_prompt_tokens
                    if request.HasField("truncate_prompt_tokens") else None)
            side = request.truncation_side or None
            check_truncation(keep, side, self.gw.max_model_len)
            t0 = timer.tokenize_started() if timer is not None else 0
            prompt_ids = await self._prompt_ids(request)
            if timer is not None and request.WhichOneof("input") != "token_ids":
                timer.tokenize_done(t0)
            prompt_ids = truncate_prompt(prompt_ids, keep, side, self.gw.max_model_len)
            first_of = set(range(n)) if request.return_prompt_token_ids else set()
            handle = ChoiceGroup(rid, self.gw.start_n(rid, prompt_ids, sampling, n,
                                                      cache_salt=request.cache_salt,
                                                      priority=request.priority))
            if timer is not None:
                track_timing(handle.handles)
            self._active[rid] = (handle, self._caller(context)[0])
            remaining = n
            async for index, delta in handle:
                if delta.error is not None:
                    raise delta.error
                resp = pb.generation.GenerateResponse(
                    request_id=rid, text=delta.text, token_ids=delta.token_ids,
                    logprobs=delta.logprobs, index=index)
                if index in first_of:
                    first_of.discard(index)
                    resp.prompt_token_ids.extend(prompt_ids)
                if delta.prompt_logprobs:   # sampling.prompt_logprobs: once, with the first token
                    resp.prompt_logprobs.extend(delta.prompt_logprobs)
                if delta.last:
                    one = handle.handles[index]
                    resp.finish_reason = finish.to_proto(delta.finish_reason)
                    resp.stop_reason = "" if delta.stop_reason is None else str(delta.stop_reason)
                    resp.usage.CopyFrom(pb.common.Usage(
                        prompt_tokens=one.num_prompt_tokens,
                        completion_tokens=one.num_completion_tokens,
                        total_tokens=one.num_prompt_tokens + one.num_completion_tokens,
                        cached_prompt_tokens=one.num_cached_tokens))
                    if timer is not None:
                        resp.timing.CopyFrom(timer.to_proto(one.timing))
                    remaining -= 1
                yield resp
                if not remaining:
                    break
        except ApiError as err:
            outcome = f"error:{err.kind}"
            await err.abort_grpc(context)
        except BaseException:
            outcome = "cancelled"
            raise
        finally:
            telemetry.detach(token)
            end_grpc_request_span(span, outcome, handle)
            if handle is not None:
                if self._active.get(rid, (None,))[0] is handle:
                    del self._active[rid]
                handle.abort()
            log.info("request id=%s route=grpc Generate outcome=%s prompt_tokens=%d "
                     "completion_tokens=%d finish=%s latency_ms=%.1f", rid, outcome,
                     handle.num_prompt_tokens if handle else 0,
                     handle.num_completion_tokens if handle else 0,
                     handle.finish_reason if handle else "-", (time.monotonic() - start) * 1e3)

    async def Tokenize(self, request, context):
        try:
            self.gw.check_model(request.model)
            which = request.WhichOneof("input")
            if which == "text":
                ids = await self.gw.tokenizer.encode(request.text, request.add_special_tokens)
            elif which == "chat":
                ids = await _tokenize_chat(self.gw, request.chat, render_only=True)
            else:
                raise ApiError("invalid_argument", "input must be one of text or chat")
            strs = (await self.gw.tokenizer.convert_ids_to_tokens(ids)
                    if request.return_token_strs and ids else [])
        except ApiError as err:
            await err.abort_grpc(context)
        return pb.generation.TokenizeResponse(token_ids=ids, count=len(ids), token_strs=strs,
                                              max_model_len=self.gw.max_model_len)

    async def ListModels(self, request, context):
        return pb.generation.ListModelsResponse(models=[pb.generation.ModelCard(
            id=self.gw.model_name, created=self.started, owned_by="meshllm",
            max_model_len=self.gw.max_model_len),
            *await self.gw.embeddings.grpc_model_cards(self.started)])

    async def Embed(self, request, context):
        return await grpc_embed(self.gw.embeddings, request, context)

    async def Abort(self, request, context):
        """Aborts the caller's own requests (an admin key: any). Another caller's request id
        counts like an unknown one: the answer tells nothing about other tenants' requests."""
        owner, admin = self._caller(context)
        aborted = 0
        for rid in request.request_ids:
            entry = self._active.get(rid)
            if entry is None or not (admin or entry[1] == owner):
                continue
            del self._active[rid]
            entry[0].abort()
            aborted += 1
        return pb.generation.AbortResponse(aborted=aborted)

    async def ResetPrefixCache(self, request, context):
        """Admin only (auth.ADMIN_GRPC_METHODS), as POST /reset_prefix_cache."""
        report, failure = await reset_prefix_caches(self.gw.engine, request.tiers)
        if failure:
            await ApiError("unavailable", failure).abort_grpc(context)
        fields = pb.generation.ReplicaPrefixCacheReset.DESCRIPTOR.fields_by_name
        return pb.generation.PrefixCacheResetResponse(
            num_blocks_flushed=report["num_blocks_flushed"],
            num_tier_blocks_flushed=report.get("num_tier_blocks_flushed", 0),
            replicas=[pb.generation.ReplicaPrefixCacheReset(**{k: v for k, v in o.items() if k in fields})
                      for o in report["replicas"]])


def add_to_server(server: grpc.aio.Server, gw: Gateway) -> GenerationServicer:
    servicer = GenerationServicer(gw)
    pb.generation_grpc.add_GenerationServicer_to_server(servicer, server)
    return servicer
