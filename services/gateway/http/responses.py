"""The OpenAI Responses API: `POST /v1/responses` (whole, streamed or in the background),
`GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}`
(docs/api_responses.md).

A request becomes the chat request that serves it (openai/responses_protocol.py) and runs the
chat path's public steps (model check, sampling rules, tool plan and enforced tool grammar,
chat template, Gateway.start_n); its output goes through the configured output parser into
output items and stream events (openai/responses_events.py). Stored responses live in a
bounded per-API-key store (openai/responses_store.py); the responses running now are in
`_Runs`, which cancel reaches (bounded by the gateway's in-flight limit: an entry lives as
long as its admitted engine request, and is removed when it ends). A background response runs
in a task of `_Runs.tasks` (held until it ends: admission bounds them like any request)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.errors import ApiError, invalid
from services.gateway.guard.auth import ApiKeys
from services.gateway.http.body import ClientGone, read_body, watch
from services.gateway.http.completions import enforce_tool_calls
from services.gateway.http.responses_log import EventLog, LogBudget, replay, sse_text
from services.gateway.http.sse import SSEResponse, coalesce
from services.gateway.openai.chat_tools import decode_for_parsers, plan_tools, template_kwargs_json
from services.gateway.openai.choices import ChoiceGroup
from services.gateway.openai.logprobs import chat_content
from services.gateway.openai.protocol import parse_body
from services.gateway.openai.responses_events import (ResponseBuilder, history_of, new_item_id,
                                                      parse_in_order, usage_of)
from services.gateway.openai.responses_protocol import (ResponsesInputTokensRequest,
                                                        ResponsesFunctionChoice, ResponsesRequest,
                                                        chat_param, input_items_of,
                                                        input_messages, resolve_references,
                                                        to_chat_request)
from services.gateway.openai.responses_store import ResponseStore
from services.gateway.parsers import make_output_parser
from services.gateway.service import Gateway

log = logging.getLogger("meshllm.gateway.responses")

CANCEL_WAIT_S = 10.0   # how long a cancel waits for the response to reach its final state


def _echo(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The request fields a response object repeats."""
    choice = req.tool_choice
    return {
        "id": response_id, "created_at": int(time.time()), "model": model,
        "background": bool(req.background), "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.stores, "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "text": req.format_param,
        "tool_choice": (choice.model_dump() if isinstance(choice, ResponsesFunctionChoice)
                        else choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "truncation": "disabled", "user": req.user, "top_logprobs": req.top_logprobs,
    }


class _Run:
    """One response being generated: its engine request, builder and parser, and what its
    end writes to the store."""

    def __init__(self, runs: "_Runs", owner: str, group: ChoiceGroup, builder: ResponseBuilder,
                 parser, conversation: list[dict[str, Any]], stores: bool,
                 input_items: list[dict[str, Any]]) -> None:
        self.runs, self.owner, self.group, self.builder = runs, owner, group, builder
        self.parser, self.conversation, self.stores = parser, conversation, stores
        self.input_items = input_items
        self.logprobs = False   # token logprobs on output_text (set by the route)
        self.log: EventLog | None = None   # a streamed background response's events
        self.cancelled = False
        self.done = asyncio.Event()
        self.id = builder.response["id"]
        runs.active[(owner, self.id)] = self
        if stores:
            runs.store.put(owner, self.id, builder.response | {"output": []}, None, input_items)

    def cancel(self) -> None:
        self.cancelled = True
        self.group.abort()

    async def run_in_background(self) -> None:
        """Generate with no client listening; the store receives the end."""
        try:
            first = await anext(self.group)
            self.builder.response["status"] = "in_progress"   # the engine has begun it
            if first[1].error is not None and not self.cancelled:
                self._log(self.builder.start() + self.finish(
                    "failed", await self._usage(),
                    {"code": "server_error", "message": first[1].error.message}))
                return
            async for events in self.events(first):
                self._log(events)
        except Exception:   # a bug: this response fails, the gateway goes on
            log.exception("background response %s failed", self.id)
            self._log(self.finish("failed", None, {"code": "server_error", "message": "internal error"}))
        finally:
            self.close()
            if self.log is not None:
                self.log.close()
                self._store()   # again, with the whole event log for later replay

    def _log(self, events: list[dict[str, Any]]) -> None:
        if self.log is not None:
            self.log.append(events)

    async def _usage(self) -> dict[str, Any]:
        reasoning_tokens = 0
        text = self.builder.reasoning_text()
        if text:   # the reasoning text re-encoded: the engine does not tell reasoning tokens apart
            try:
                reasoning_tokens = len(await self.runs.gw.tokenizer.encode(text, False))
            except ApiError:
                pass
        g = self.group
        return usage_of(g.num_prompt_tokens, g.num_completion_tokens, g.num_cached_tokens,
                        reasoning_tokens)

    async def events(self, first) -> AsyncIterator[list[dict[str, Any]]]:
        """The stream events, a list per engine wake-up, ending with the final one."""
        yield self.builder.start()
        pending = [first]
        while True:
            for _, delta in pending:
                if delta.error is not None:
                    status = "cancelled" if self.cancelled else "failed"
                    error = None if self.cancelled else {"code": "server_error",
                                                         "message": delta.error.message}
                    yield self.finish(status, await self._usage(), error)
                    return
                events = [e for piece in parse_in_order(self.parser, delta.text, delta.last)
                          for e in self.builder.feed(piece)]
                if self.logprobs and delta.logprobs:
                    self.builder.add_logprobs(chat_content(delta.logprobs, delta.token_strings),
                                              events)
                if delta.last:
                    status = "incomplete" if delta.finish_reason == "length" else "completed"
                    yield events + self.finish(status, await self._usage())
                    return
                if events:
                    yield events
            pending = coalesce([await anext(self.group), *self.group.ready()])

    def finish(self, status: str, usage: dict[str, Any] | None,
               error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """End the response (once) and keep it when it is stored."""
        if self.done.is_set():
            return []
        events = self.builder.finish(status, usage, error=error, completed_at=int(time.time()))
        self._store()
        self.close()
        return events

    def _store(self) -> None:
        if self.stores:
            history = self.conversation + history_of(self.builder.output)
            self.runs.store.put(self.owner, self.id, self.builder.response, history,
                                self.input_items, self.log.texts if self.log else None)

    def close(self) -> None:
        """Stop listening (idempotent): a response that has not ended is cancelled."""
        self.group.abort()
        if not self.done.is_set() and self.builder.response["status"] in ("queued", "in_progress"):
            g = self.group
            self.finish("cancelled", usage_of(g.num_prompt_tokens, g.num_completion_tokens,
                                              g.num_cached_tokens))
            return
        self.done.set()
        self.runs.active.pop((self.owner, self.id), None)


class _SseBody:
    """The SSE body of a streamed response; SSEResponse always calls aclose(), which ends the
    run even when the stream never started (the client left first)."""

    def __init__(self, run: _Run, first) -> None:
        self.run = run
        self._events = run.events(first)

    def __aiter__(self) -> "_SseBody":
        return self

    async def __anext__(self) -> str:
        return "".join(map(sse_text, await anext(self._events)))

    async def aclose(self) -> None:
        await self._events.aclose()
        self.run.close()


class _Runs:
    def __init__(self, gw: Gateway) -> None:
        cfg = gw.config
        self.gw = gw
        self.store = ResponseStore(cfg.responses_store_max_entries, cfg.responses_store_max_bytes,
                                   cfg.responses_store_ttl_s)
        self.active: dict[tuple[str, str], _Run] = {}
        self.tasks: set[asyncio.Task] = set()   # background responses (a reference keeps each)
        self.log_budget = LogBudget(cfg.responses_store_max_bytes)   # their event logs, together
        self.keys = ApiKeys(cfg.api_keys, cfg.admin_api_keys)

    def owner(self, request: Request) -> str:
        return self.keys.principal(request.headers.get("authorization"))[0]

    def history(self, owner: str, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a previous_response_id continues ([] without one)."""
        if previous_response_id is None:
            return []
        previous = self.stored(owner, previous_response_id, "previous_response_id")
        if previous.history is None:
            raise invalid(f"response {previous_response_id!r} is still in progress",
                          "previous_response_id")
        return previous.history

    def resolved(self, owner: str, items):
        """The input with its item references replaced by `owner`'s stored items."""
        return resolve_references(items, lambda item_id: self.store.find_item(owner, item_id))

    def stored(self, owner: str, response_id: str, param: str = "response_id"):
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise ApiError("not_found", f"Response with id {response_id!r} not found.", param=param)
        return entry


def _stream_again(stored, run: _Run | None, starting_after: str | None) -> Response:
    """A streamed background response's events after `starting_after`: followed while it runs,
    replayed once it is over."""
    if starting_after is not None and not starting_after.isdigit():
        raise invalid("starting_after must be a sequence number (an integer >= 0)",
                      "starting_after")
    after = int(starting_after) if starting_after is not None else -1
    if run is not None and run.log is not None:
        events = run.log.follow(after)
    elif stored.events is not None:
        events = replay(stored.events, after)
    else:
        raise invalid("only a background response created with stream true can be streamed "
                      "again", "stream")
    return SSEResponse(events, on_disconnect=lambda: None, headers={"Cache-Control": "no-cache"})


async def _drain(events: AsyncIterator) -> None:
    async for _ in events:
        pass


def add_responses_routes(app: FastAPI, gw: Gateway) -> None:
    cfg = gw.config
    runs = _Runs(gw)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = parse_body(ResponsesRequest, await read_body(request, cfg.max_body_bytes))
        owner = runs.owner(request)
        history = runs.history(owner, req.previous_response_id)
        req.input = runs.resolved(owner, req.input)
        response_id = new_item_id("resp")
        try:
            chat = to_chat_request(req, history)
            gw.check_model(chat.model)
            sampling = chat.to_sampling()
            plan = plan_tools(chat.tools, chat.tool_choice, cfg.tool_call_parser)
            structured_param = chat.structured_param
            if plan.forced:   # required / named: the output is tool calls, enforced by a grammar
                if sampling.HasField("structured"):   # (said in this API's words)
                    raise invalid("tool_choice required or a named function already constrains "
                                  "the output: it cannot be combined with text.format "
                                  f"{req.text.format.type}", "tool_choice")
                enforce_tool_calls(sampling, chat, plan.allowed_names, cfg)
                structured_param = "tools"
            await gw.check_sampling(sampling, chat.rule_options(), structured_param)
            prompt_ids = await gw.tokenize_chat(
                chat.to_chat_messages(), tools_json=plan.tools_json,
                chat_template_kwargs_json=template_kwargs_json(chat.chat_template_kwargs))
            tool_parser = cfg.tool_call_parser if plan.parse_tool_calls else None
            decode_for_parsers(sampling, cfg.reasoning_parser, tool_parser)   # markers that are special tokens
            handles = gw.start_n(response_id, prompt_ids, sampling, 1, prompt_param="input",
                                 cache_salt=chat.cache_salt or "", priority=chat.priority)
        except ApiError as err:
            err.param = chat_param(err.param)
            raise
        group = ChoiceGroup(response_id, handles)
        request.state.handle = group
        parser = make_output_parser(cfg.reasoning_parser, tool_parser,
                                    allowed_tools=plan.allowed_names, tools=chat.tools)
        builder = ResponseBuilder(_echo(req, response_id, req.model or gw.model_name))
        if req.background:   # until its first engine step
            builder.response["status"] = "queued"
        run = _Run(runs, owner, group, builder, parser, history + input_messages(req.input),
                   req.stores, input_items_of(req.input, new_item_id) if req.stores else [])
        run.logprobs = req.wants_logprobs
        if req.background:
            if req.stream:   # this request follows the run's log; it runs on if the client goes
                run.log = EventLog(runs.log_budget)
            task = asyncio.create_task(run.run_in_background())
            runs.tasks.add(task)
            task.add_done_callback(runs.tasks.discard)
            if run.log is not None:
                return SSEResponse(run.log.follow(), on_disconnect=lambda: None,
                                   headers={"Cache-Control": "no-cache"})
            return JSONResponse(builder.response | {"output": []})
        try:
            # Wait for the first step before committing to 200, so early failures get a status.
            first = await watch(request, group, anext(group))
            if first[1].error is not None and not run.cancelled:
                run.finish("failed", None, {"code": "server_error", "message": first[1].error.message})
                raise first[1].error
            if req.stream:
                def on_disconnect() -> None:
                    request.state.outcome = "client_disconnected"
                    run.cancel()

                return SSEResponse(_SseBody(run, first), on_disconnect=on_disconnect,
                                   headers={"Cache-Control": "no-cache"})
            await watch(request, group, _drain(run.events(first)))
        except ClientGone:
            request.state.outcome = "client_disconnected"
            run.close()
            return Response(status_code=499)
        except BaseException:
            run.close()
            raise
        run.close()
        return JSONResponse(builder.response)

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(request: Request) -> Response:
        """The prompt's token count for a would-be request (rendered, nothing generated)."""
        req = parse_body(ResponsesInputTokensRequest, await read_body(request, cfg.max_body_bytes)).request()
        owner = runs.owner(request)
        history = runs.history(owner, req.previous_response_id)
        req.input = runs.resolved(owner, req.input)
        try:
            chat = to_chat_request(req, history)
            gw.check_model(chat.model)
            chat.check_unsupported()
            plan = plan_tools(chat.tools, chat.tool_choice, cfg.tool_call_parser)
            prompt_ids = await gw.tokenize_chat(
                chat.to_chat_messages(), tools_json=plan.tools_json,
                chat_template_kwargs_json=template_kwargs_json(chat.chat_template_kwargs))
        except ApiError as err:
            err.param = chat_param(err.param)
            raise
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        q = request.query_params
        for name in ("include", "include_obfuscation"):
            if q.get(name) not in (None, "", "false"):
                raise invalid(f"the query parameter {name} is not supported", name)
        owner = runs.owner(request)
        stored = runs.stored(owner, response_id)
        run = runs.active.get((owner, response_id))
        if q.get("stream") == "true":
            return _stream_again(stored, run, q.get("starting_after"))
        if q.get("stream") not in (None, "", "false") or q.get("starting_after") is not None:
            raise invalid("starting_after needs stream=true", "starting_after")
        if run is not None and run.stores and not run.done.is_set():
            # Running: the output so far (the store receives it when the response ends).
            return JSONResponse(run.builder.response | {"output": list(run.builder.output)})
        return JSONResponse(stored.body)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> Response:
        q = request.query_params
        if q.get("include"):
            raise invalid("include is not supported", "include")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order must be 'asc' or 'desc'", "order")
        limit = q.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise invalid("limit must be an integer from 1 to 100", "limit")
        items = runs.stored(runs.owner(request), response_id).input_items
        items = items if order == "asc" else items[::-1]
        after = q.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise invalid(f"no input item {after!r} in response {response_id!r}", "after")
            items = items[at + 1:]
        page = items[:int(limit)]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > len(page)})

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        owner = runs.owner(request)
        run = runs.active.get((owner, response_id))
        if run is not None:
            run.stores = False   # its end must not store it again
        if not runs.store.delete(owner, response_id):
            raise ApiError("not_found", f"Response with id {response_id!r} not found.",
                           param="response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        owner = runs.owner(request)
        run = runs.active.get((owner, response_id))
        if run is None:
            body = runs.stored(owner, response_id).body
            if body.get("background"):   # over already: cancelling it changes nothing (OpenAI)
                return JSONResponse(body)
            raise invalid(f"response {response_id!r} has status {body.get('status')!r}: only a "
                          "background response, or one still running, can be cancelled",
                          "response_id")
        run.cancel()
        try:
            await asyncio.wait_for(run.done.wait(), CANCEL_WAIT_S)
        except TimeoutError:
            run.close()
        return JSONResponse(run.builder.response)
