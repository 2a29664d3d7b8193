"""Anthropic Messages request bodies (pydantic) and their SamplingParams.

Shapes follow Anthropic's API reference: unknown fields are a 400 naming them (Anthropic
refuses them too), content blocks are told apart by `type`. Blocks a text-only model cannot
read (image, document) parse here and are refused by convert.py with the block's path, so
the message says which block it was. Ranges of top_p / top_k / max_tokens / stop strings are
the sampling rulebook's (services/common/sampling_rules.py); only what is Anthropic's own
(temperature in [0, 1], the thinking budget) is checked here."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from services.common import pb
from services.common.sampling_rules import RequestOptions
from services.gateway.errors import invalid
from services.gateway.guard.sampling import check_int32

MIN_THINKING_BUDGET = 1024   # Anthropic: budget_tokens >= 1024 and < max_tokens


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- content blocks ---------------------------------------------------------------------------

class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None   # accepted: prefix caching here is automatic
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Strict):
    """Parsed so the refusal can name the block: the served model reads text only."""
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(_Strict):
    """Parsed so the refusal can name the block (PDF / document inputs are not read)."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["document"]
    source: dict[str, Any]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


ToolResultPart = Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict):
    """An earlier turn's thinking, passed back as Anthropic asks: accepted, not re-rendered."""
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock,
                               ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]


class MessageIn(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


# -- tools ------------------------------------------------------------------------------------

class ToolDefinition(_Strict):
    """A client tool. Anthropic's server tools (web search, bash, ...) run on Anthropic's side
    and have other shapes: they are refused as unknown fields / types."""
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


# -- thinking ---------------------------------------------------------------------------------

class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled],
                     Field(discriminator="type")]


class RequestMetadata(_Strict):
    user_id: str | None = None


class JsonOutputFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    # `schema` would shadow a BaseModel attribute: stored as schema_, spelled "schema" on the wire.
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None   # accepted; not used
    format: JsonOutputFormat | None = None   # structured output: the text follows the schema


# -- requests ---------------------------------------------------------------------------------

class PromptRequest(_Strict):
    """What makes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""
    model: str
    messages: list[MessageIn]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None   # accepted: prefix caching here is automatic

    @property
    def thinking_on(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"


class CountTokensRequest(PromptRequest):
    pass


class MessagesRequest(PromptRequest):
    max_tokens: int                    # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: RequestMetadata | None = None   # accepted; user_id is not used
    # Accepted and not used: one tier, one speed and one place of inference here.
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None

    def to_sampling(self) -> "pb.common.SamplingParams":
        """The engine's SamplingParams, range-checked later by gw.check_sampling with
        `rule_options()` (Anthropic's own rules are checked here)."""
        check_int32("max_tokens", self.max_tokens)
        if self.top_k is not None:
            check_int32("top_k", self.top_k)
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise invalid(f"temperature: must be in [0, 1], got {self.temperature}", "temperature")
        if isinstance(self.thinking, ThinkingEnabled):
            budget = self.thinking.budget_tokens
            if budget < MIN_THINKING_BUDGET:
                raise invalid(f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET}, "
                              f"got {budget}", "thinking")
            if budget >= self.max_tokens:
                raise invalid(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                              f"({self.max_tokens})", "thinking")
        sp = pb.common.SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            max_tokens=self.max_tokens,
            skip_special_tokens=True,
            stop=self.stop_sequences or [])
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:   # checked with the rest of the sampling (Gateway.check_sampling)
            sp.structured.json_schema = json.dumps(fmt.schema_)
        return sp

    def rule_options(self) -> RequestOptions:
        # The wire's 0 means "default"; an explicit 0 here is out of range, not a default.
        zeros = frozenset(name for name, value in (("max_tokens", self.max_tokens),
                                                   ("top_p", self.top_p)) if value == 0)
        return RequestOptions(explicit_zeros=zeros)
