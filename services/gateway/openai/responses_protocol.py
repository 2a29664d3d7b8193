"""The OpenAI Responses API request body (`POST /v1/responses`, pydantic) and its conversion to
the chat request the gateway already serves.

A Responses request is a chat request in another shape: `input` items become chat messages
(function_call items an assistant turn's tool_calls, function_call_output items tool turns),
`instructions` a leading system message, `tools` / `tool_choice` / `text.format` the chat
`tools` / `tool_choice` / `response_format`. `to_chat_request` builds that
ChatCompletionRequest, so sampling, tool plans, enforced tool grammars and structured outputs
go through the chat path's own validation (openai/protocol.py, chat_tools.py, tool_grammar.py)
rather than a copy of it; `chat_param` names the Responses field in the errors it raises.

What the Responses API has and this server does not do is refused with a 400 that names the
field (built-in tools, non-text inputs, other `include` values, truncation "auto", ...);
docs/api_responses.md lists every field with its status."""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from services.gateway.errors import invalid
from services.gateway.openai.protocol import ChatCompletionRequest, describe_validation_error

MAX_METADATA_KEYS = 16          # OpenAI's bounds on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 2048
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_STRICT = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
_PART_TYPES = ("input_text", "output_text")


def _only(*values: Any) -> dict[str, Any]:
    """The JSON Schema (GET /openapi.json) of a field accepted only absent, null or at `values`:
    the type admits more, so a refusal can name the field (check_unsupported)."""
    return {"anyOf": [*({"const": v} for v in values), {"type": "null"}]}


class ResponsesTextPart(BaseModel):
    """input_text (user turns) or output_text (an earlier output message passed back)."""
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None     # output_text passed back: output metadata
    logprobs: list[Any] | None = None


def _check_parts(value: Any, where: str) -> Any:
    """A clear refusal for a content part this server cannot read (images, files, audio)."""
    if isinstance(value, list):
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in _PART_TYPES:
                raise ValueError(f"{where}[{j}] is of type {kind!r}: only text inputs "
                                 f"({', '.join(_PART_TYPES)}) are supported")
    return value


class ResponsesMessage(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponsesTextPart]
    id: str | None = None                    # an output message passed back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _check_parts(v, "content")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponsesFunctionCall(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesFunctionCallOutput(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ResponsesTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _check_parts(v, "output")

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


class ResponsesReasoning(BaseModel):
    """An earlier output's reasoning passed back: accepted, and left out of the prompt (chat
    templates drop earlier turns' reasoning too)."""
    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesItemReference(BaseModel):
    """An item of a stored response (input or output) by its id, resolved before anything else
    (resolve_references)."""
    model_config = _STRICT
    type: Literal["item_reference"]
    id: str = Field(min_length=1)


InputItem = Annotated[Union[ResponsesMessage, ResponsesFunctionCall, ResponsesFunctionCallOutput,
                            ResponsesReasoning, ResponsesItemReference],
                      Field(discriminator="type")]


class ResponsesFunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None    # the arguments of enforced calls always follow the schema

    def to_chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


class ResponsesFunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class ResponsesTextFormat(BaseModel):
    """text.format: text (default), json_object, or json_schema (name + schema)."""
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None
    # `schema` would shadow a BaseModel attribute: stored as schema_, spelled "schema" on the wire.
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def to_chat(self) -> dict[str, Any] | None:
        if self.type == "text":
            if self.schema_ is not None or self.name is not None:
                raise invalid("text.format of type text takes no name or schema", "text")
            return None
        if self.type == "json_object":
            if self.schema_ is not None:
                raise invalid("text.format.schema is only allowed with type json_schema", "text")
            return {"type": "json_object"}
        if self.schema_ is None or not self.name:
            raise invalid("text.format of type json_schema needs a name and a schema", "text")
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        if self.description is not None:
            spec["description"] = self.description
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}


class ResponsesTextConfig(BaseModel):
    model_config = _STRICT
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, json_schema_extra=_only("medium"))


class ResponsesReasoningConfig(BaseModel):
    model_config = _STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, json_schema_extra=_only())
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, json_schema_extra=_only())


class ResponsesStreamOptions(BaseModel):
    model_config = _STRICT
    include_obfuscation: bool | None = Field(None, json_schema_extra=_only(False))


class _PromptFields(BaseModel):
    """What shapes a request's prompt (shared by a response and its input-token count)."""
    model_config = _STRICT

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = Field(None, json_schema_extra=_only("disabled"))

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, v: Any) -> Any:
        """A clear refusal for an item this server cannot take (built-in tool calls, item
        references, ...); an item without `type` but with a `role` is a message."""
        if not isinstance(v, list):
            return v
        if len(v) > MAX_INPUT_ITEMS:
            raise ValueError(f"at most {MAX_INPUT_ITEMS} input items are allowed, got {len(v)}")
        out = []
        for i, item in enumerate(v):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in _ITEM_TYPES:
                raise ValueError(f"input[{i}] is of type {kind!r}, which this server does not "
                                 f"support (supported: {', '.join(_ITEM_TYPES)})")
            out.append(item)
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools[{i}] is a {kind!r} tool: only function tools are "
                                 "supported (no built-in tools on this server)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"tool_choice of type {v.get('type')!r} is not supported: use "
                             "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")
        return v

class ResponsesRequest(_PromptFields):
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, str] | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "object", "maxProperties": MAX_METADATA_KEYS,
         "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
         "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS}}, {"type": "null"}]})
    user: str | None = None
    background: bool | None = None     # run without the client: poll, cancel (needs store)
    # Refused unless absent or at their "off" value (a 400 naming the field, check_unsupported).
    include: list[str] | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "array", "items": {"enum": [LOGPROBS_INCLUDE]}}, {"type": "null"}]})
    top_logprobs: int | None = None    # alternatives per token (logprobs on, as with include)
    max_tool_calls: int | None = Field(None, json_schema_extra=_only())
    # OpenAI account fields that change nothing on this server (as on the chat route).
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Extra body (vLLM): sampling knobs the chat route takes too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys are allowed, got {len(v)}")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters and "
                                 f"values at most {MAX_METADATA_VALUE_CHARS}")
        return v

    # -- what this server does not do ---------------------------------------------------------
    def check_unsupported(self) -> None:
        refusals = (
            ("background", bool(self.background and self.store is False), "a background "
             "response must be stored: it is read with GET /v1/responses/{id}; omit store"),
            ("include", any(v != LOGPROBS_INCLUDE for v in self.include or ()), "include "
             f"takes only {LOGPROBS_INCLUDE!r} here (no encrypted reasoning, images or tool "
             "sources are returned)"),
            ("truncation", self.truncation == "auto", "truncation 'auto' is not supported: an "
             "input over the context is refused, not truncated"),
            ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls applies to "
             "built-in tools, which this server does not have"),
        )
        for param, given, message in refusals:
            if given:
                raise invalid(message, param)
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise invalid("text.verbosity: only 'medium' (the default) is supported", "text")
        if self.reasoning is not None and (self.reasoning.summary or self.reasoning.generate_summary):
            raise invalid("reasoning summaries are not produced: the reasoning parser's text is "
                          "returned as reasoning_text content instead", "reasoning")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise invalid("stream obfuscation is not supported: omit include_obfuscation or "
                          "send false", "stream_options")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream true", "stream_options")

    # -- the equivalent chat request ----------------------------------------------------------
    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        """Token logprobs on output_text: asked for by include, or by top_logprobs > 0."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    @property
    def format_param(self) -> dict[str, Any]:
        """`text` as the response echoes it."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                "verbosity": "medium"}


class ResponsesInputTokensRequest(_PromptFields):
    """`POST /v1/responses/input_tokens`: the fields of a request that shape its prompt."""
    input: str | list[InputItem] | None = None

    def request(self) -> ResponsesRequest:
        fields = {k: v for k, v in self if v is not None}
        return ResponsesRequest.model_construct(**{"input": [], **fields})


_REFERABLE = TypeAdapter(InputItem)


def resolve_references(items: str | list, find: Callable[[str], dict[str, Any] | None]) -> str | list:
    """`items` with each item_reference replaced by the stored item it names (`find(id)`: the
    caller's own stored items only); one that names nothing is a 400."""
    if isinstance(items, str) or not any(isinstance(i, ResponsesItemReference) for i in items):
        return items
    out = []
    for i, item in enumerate(items):
        if isinstance(item, ResponsesItemReference):
            found = find(item.id)
            if found is None or found.get("type") == "item_reference":
                raise invalid(f"input[{i}] references item {item.id!r}, which is not in a stored "
                              "response of this API key", "input")
            try:
                item = _REFERABLE.validate_python(found)
            except ValidationError:
                raise invalid(f"input[{i}]: the stored item {item.id!r} cannot be used as input",
                              "input") from None
        out.append(item)
    return out


def input_messages(items: str | list) -> list[dict[str, Any]]:
    """The `input` as chat messages: consecutive function_call items are one assistant turn
    (joined to the assistant message right before them), each output a tool turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    calls_open = False   # the last message is an assistant turn that function_calls may join
    for item in items:
        if isinstance(item, ResponsesMessage):
            messages.append({"role": item.role, "content": item.text()})
            calls_open = item.role == "assistant"
        elif isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if calls_open:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                calls_open = True
        elif isinstance(item, ResponsesFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            calls_open = False
    return messages


def input_items_of(items: str | list, new_id) -> list[dict[str, Any]]:
    """The `input` as GET /v1/responses/{id}/input_items lists it: every item with an id (given,
    or `new_id(prefix)`), text content as parts."""
    if isinstance(items, str):
        items = [ResponsesMessage(role="user", content=items)]
    out: list[dict[str, Any]] = []
    for item in items:
        listed = item.model_dump(by_alias=True, exclude_none=True)
        if isinstance(item, ResponsesMessage):
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                listed["content"] = [{"type": kind, "text": item.content}]
            prefix = "msg"
        else:
            prefix = {"function_call": "fc", "function_call_output": "fco"}.get(item.type, "rs")
        if "id" not in listed:
            listed["id"] = new_id(prefix)
        listed.setdefault("status", "completed")
        out.append(listed)
    return out


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves `req`: [instructions] + `history` (the conversation of its
    previous_response_id, without that one's instructions) + its input."""
    req.check_unsupported()
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + input_messages(req.input)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "seed": req.seed,
        "priority": req.priority, "cache_salt": req.cache_salt, "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [tool.to_chat() for tool in req.tools]
    if isinstance(req.tool_choice, ResponsesFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.to_chat()
    if req.wants_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.reasoning is not None and req.reasoning.effort is not None:
        # Templates that read it (gpt-oss, Qwen3 style) get it as `reasoning_effort`.
        body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as err:   # a value the chat request refuses (a seed past int64, ...)
        raise describe_validation_error(err) from None


# Chat fields whose errors name their Responses field instead.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text",
           "chat_template_kwargs": "reasoning", "prompt": "input"}


def chat_param(param: str | None) -> str | None:
    return _PARAMS.get(param, param) if param is not None else None
