"""OpenAI request bodies (pydantic) and their conversion to the engine's SamplingParams.

Type errors become a readable 400 (never FastAPI's 422). Unknown top-level fields are a 400
naming the field: a request can select no server internal (a template, a parser, a
backend). OpenAI fields we accept and ignore are listed in `_IgnoredOpenAIFields`. Only
OpenAI's shapes are handled here (types, defaults, `stop` as str or list, logprobs /
top_logprobs, refusals of what we do not support, values the int32 wire cannot carry); the
ranges are the sampling rulebook's (services/common/sampling_rules.py), which the gRPC API
shares, fed by `rule_options()`. Body-level limits (JSON depth, UTF-8) are in `parse_body`."""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.common import pb
from services.common.json_limits import json_depth_exceeds
from services.common.sampling_rules import RequestOptions
from services.gateway.errors import ApiError, invalid
from services.gateway.guard.sampling import check_int32

MAX_JSON_DEPTH = 64             # nesting of the whole request body
MAX_TOOLS_JSON_BYTES = 256 * 1024
MAX_TOOLS_DEPTH = 32            # nesting inside `tools` (JSON schemas of the parameters)



MAX_BATCH_PROMPTS = 64         # completions: prompts in one request
MAX_BATCH_CHOICES = 256        # completions: prompts x n engine requests in one request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False     # null = false (vLLM and the SDK send it)
    continuous_usage_stats: bool | None = False   # vLLM: usage on every chunk (needs include_usage)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema (OpenAI): the schema is kept; name, description and strict are
    accepted for the SDK (the output always follows the schema: strict or not)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    strict: bool | None = None
    # `schema` would shadow a BaseModel attribute: stored as schema_, spelled "schema" on the wire.
    schema_: dict[str, Any] | bool = Field(alias="schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one constraint. vLLM's tuning knobs
    (whitespace_pattern, disable_* ...) select backend behaviour and are refused as unknown."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # `json` shadows BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _structured_output(kind: str, value: Any) -> "pb.common.StructuredOutput":
    """One constraint as the wire's StructuredOutput; its bounds and its grammar are checked
    later, once, by the rulebook path (Gateway.check_sampling), for HTTP and gRPC alike."""
    if kind == "json_schema":
        text = value if isinstance(value, str) else json.dumps(value)
        return pb.common.StructuredOutput(json_schema=text)
    if kind == "choice":
        return pb.common.StructuredOutput(choice=pb.common.ChoiceList(choices=value))
    return pb.common.StructuredOutput(**{kind: value})


class _IgnoredOpenAIFields(BaseModel):
    """OpenAI request fields that change nothing here; accepted so SDK users aren't refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class _SamplingFields(_IgnoredOpenAIFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None          # extra body (vLLM)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Any = None                  # str | list[str], checked below for a clear message
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    priority: int = 0                 # extra body (vLLM): lower runs first under --scheduling-policy priority
    cache_salt: str | None = None     # extra body (vLLM): prefix-cache isolation between tenants
    return_timing: bool = False       # extra body: a `timing` breakdown in the response (timing.py)
    # extra body (vLLM): prompt_token_ids and token_ids in the response and its chunks
    return_token_ids: bool | None = None
    # extra body (vLLM): each prompt token's logprob and rank with the top N (openai/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None   # extra body (vLLM): logprob tokens as "token_id:<id>"
    # extra body (vLLM): keep k prompt tokens (-1 = the context length); which end is kept
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None     # extra body (vLLM)
    # vLLM's older spellings of structured_outputs' json / regex / choice / grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    LOGPROBS_PARAM: ClassVar[str] = "logprobs"  # the field that carries the top-logprobs count

    @field_validator("stop")
    @classmethod
    def _stop_is_str_or_list(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("seed")
    @classmethod
    def _seed_fits_int64(cls, v: int | None) -> int | None:
        if v is not None and not -(2 ** 63) <= v < 2 ** 63:
            raise ValueError("must fit in a signed 64-bit integer")
        return v

    def _effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        """Top logprobs per token for the engine (None: no logprobs)."""
        return None

    def _prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt position for the engine (None: none)."""
        return self.prompt_logprobs

    def _constraints(self) -> list[tuple[str, str, Any]]:
        """Every output constraint the body names: (request field, StructuredOutput kind, value)."""
        found: list[tuple[str, str, Any]] = []
        fmt = self.response_format
        if fmt is not None:
            if fmt.type == "json_schema":
                if fmt.json_schema is None:
                    raise invalid("response_format of type json_schema needs a json_schema object "
                                  "({\"name\": ..., \"schema\": {...}})", "response_format")
                found.append(("response_format", "json_schema", fmt.json_schema.schema_))
            elif fmt.json_schema is not None:
                raise invalid(f"response_format.json_schema is only allowed with type json_schema, "
                              f"not {fmt.type}", "response_format")
            elif fmt.type == "json_object":
                found.append(("response_format", "json_object", True))
        so = self.structured_outputs
        if so is not None:
            given = [(kind, value) for kind, value in (
                ("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                ("grammar", so.grammar), ("json_object", so.json_object)) if value is not None]
            if len(given) != 1:
                raise invalid("structured_outputs needs exactly one of json, regex, choice, grammar "
                              f"or json_object, got {len(given)}", "structured_outputs")
            found.append(("structured_outputs", *given[0]))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, kind, getattr(self, name)))
        if len(found) > 1:
            names = [f for f, _, _ in found]
            raise invalid(f"only one output constraint is allowed per request, got {', '.join(names)}",
                          names[0])
        return found

    @property
    def structured_param(self) -> str:
        """The request field the output constraint came from: the rulebook's refusals name it."""
        found = self._constraints()
        return found[0][0] if found else "structured_outputs"

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def check_unsupported(self) -> None:
        """Refuse what OpenAI has and we do not do (the rulebook has the ranges)."""
        if self.best_of is not None and self.best_of != 1:
            raise invalid(f"best_of={self.best_of} is not supported yet: only 1 is", "best_of")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            # OpenAI and vLLM answer 400 too: the options only shape a stream (an empty object
            # passes, as vLLM lets it).
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs and self.stream:   # vLLM's rule: a stream never carries them
            raise invalid("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.truncate_prompt_tokens is not None:
            check_int32("truncate_prompt_tokens", self.truncate_prompt_tokens)

    def to_sampling(self) -> "pb.common.SamplingParams":
        """The engine's SamplingParams, not yet range-checked (gw.check_sampling with
        `rule_options()` does that); max_tokens 0 = not given (fit_to_prompt resolves it)."""
        self.check_unsupported()
        max_tokens = self._effective_max_tokens()
        top_k = self.top_k if self.top_k is not None else 0
        for name, value in (("max_tokens", max_tokens), ("top_k", top_k),
                            ("min_tokens", self.min_tokens), (self.LOGPROBS_PARAM, self._logprobs())):
            if value is not None:
                check_int32(name, value)
        sp = pb.common.SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 0.0,
            max_tokens=max_tokens or 0,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        if self.seed is not None:
            sp.seed = self.seed
        for _, kind, value in self._constraints():
            sp.structured.CopyFrom(_structured_output(kind, value))
        if self._logprobs() is not None:
            sp.logprobs = self._logprobs()
        if self._prompt_logprobs() is not None:
            check_int32("prompt_logprobs", self._prompt_logprobs())
            sp.prompt_logprobs = self._prompt_logprobs()
        for tid in self.stop_token_ids or []:
            check_int32("stop_token_ids", tid)
            sp.stop_token_ids.append(tid)
        for key, bias in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            check_int32("logit_bias", tid)
            sp.logit_bias[tid] = bias
        return sp

    def rule_options(self) -> RequestOptions:
        """The rest of what the rulebook checks: n, cache_salt, priority, and the fields
        given as an explicit 0 (OpenAI's 0 is out of range where the wire's 0 is "default")."""
        zeros = frozenset(name for name, value in (
            ("max_tokens", self._effective_max_tokens()), ("top_p", self.top_p),
            ("repetition_penalty", self.repetition_penalty)) if value == 0)
        return RequestOptions(n=self.num_choices, cache_salt=self.cache_salt or "",
                              priority=self.priority, explicit_zeros=zeros,
                              logprobs_param=self.LOGPROBS_PARAM)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionRequest(_SamplingFields):
    # required: a string, a list of token ids, or a batch (a list of strings or of token-id
    # lists); checked below for a clear message
    prompt: Any
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> str | list[int] | list[str] | list[list[int]]:
        """One prompt, or a batch of them (a one-element batch is unwrapped)."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str) or _is_token_ids(v):
            return v
        if isinstance(v, list) and (all(isinstance(p, str) for p in v)
                                    or all(isinstance(p, list) and _is_token_ids(p) for p in v)):
            if len(v) > MAX_BATCH_PROMPTS:
                raise ValueError(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(v)}")
            return v
        raise ValueError("must be a string, a list of token ids, a list of strings or a list of "
                         "token-id lists")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, each a string or a list of token ids."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        choices = len(self.prompts) * self.num_choices
        if len(self.prompts) > 1 and choices > MAX_BATCH_CHOICES:
            raise invalid(f"prompts x n must be at most {MAX_BATCH_CHOICES}, got {choices}", "n")

    def _logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """The scoring call (OpenAI's legacy API, vLLM): echo with max_tokens 0 answers the prompt
        alone; the engine runs one token, which the choice drops (choices.py)."""
        return bool(self.echo) and self.max_tokens == 0

    def _effective_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def _prompt_logprobs(self) -> int | None:
        """vLLM: echo with logprobs scores the echoed prompt too (prompt_logprobs = logprobs)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # assistant turns that called tools
    tool_call_id: str | None = None                  # tool turns: the call answered

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise invalid(f"messages[{index}].content: only text parts are supported, "
                              f"got a part of type {part.type!r}", "messages")
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None   # OpenAI; accepted, not used by our templates
    # extra body (vLLM): prefix the answer with the last message's content when that message
    # is the turn being answered (its role is the response's role)
    echo: bool = False
    LOGPROBS_PARAM: ClassVar[str] = "top_logprobs"

    def _effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        if not self.messages:
            raise invalid("messages must contain at least one message", "messages")
        if self.tools:
            check_tools(self.tools)
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid("add_generation_prompt and continue_final_message cannot both be "
                          "true", "continue_final_message")

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def response_role(self) -> str:
        """vLLM's role of the answer: the assistant's after a generation prompt, else the last
        message's (the turn that is being continued)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """What `echo` prefixes (vLLM): the last message's content if its role is the response's."""
        if not self.echo or not self.messages or self.messages[-1].role != self.response_role:
            return ""
        return self.messages[-1].text(len(self.messages) - 1)

    def to_chat_messages(self) -> list["pb.common.ChatMessage"]:
        return [pb.common.ChatMessage(
            role=m.role, content=m.text(i), name=m.name or "",
            tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "",
            tool_call_id=m.tool_call_id or "") for i, m in enumerate(self.messages)]


def describe_validation_error(err: ValidationError) -> ApiError:
    """A pydantic error as one readable 400 (the first few problems, with field paths)."""
    problems, param = [], None
    unknown = [e for e in err.errors(include_url=False) if e.get("type") == "extra_forbidden"]
    if unknown:
        loc = [str(p) for p in unknown[0].get("loc", ())]
        return invalid(f"unknown field {'.'.join(loc)!r}: this server does not accept it",
                       loc[0] if loc else None)
    for e in err.errors(include_url=False)[:3]:
        loc = [str(p) for p in e.get("loc", ())]
        if e.get("type") in ("json_invalid", "json_type"):
            return invalid(f"the request body is not valid JSON: {e.get('msg')}")
        if e.get("type") == "model_type" and not loc:
            return invalid("the request body must be a JSON object")
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if param is None and loc:
            param = loc[0]
        path = ".".join(loc) if loc else "body"
        problems.append(f"{path}: {msg}")
    return invalid("; ".join(problems) or "invalid request", param)


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping once past `limit`."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_tools(tools: list[dict[str, Any]]) -> None:
    size = len(json.dumps(tools))
    if size > MAX_TOOLS_JSON_BYTES:
        raise invalid(f"tools must be at most {MAX_TOOLS_JSON_BYTES} bytes of JSON, got {size}",
                      "tools")
    if _depth(tools, MAX_TOOLS_DEPTH) > MAX_TOOLS_DEPTH:
        raise invalid(f"tools nest deeper than {MAX_TOOLS_DEPTH} levels", "tools")


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        if any(e.get("type") == "json_invalid" for e in err.errors(include_url=False)):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise invalid(f"the request body is not valid UTF-8 (byte {bad.start})") from None
        raise describe_validation_error(err) from None
