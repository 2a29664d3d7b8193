"""The one parser interface: model output -> reasoning, content and tool calls.

Pure values in, values out (no I/O). Each concrete parser has two halves that must agree
(the conformance suite checks it on golden outputs split at every boundary):

- `feed(text) -> piece` / `finish() -> piece`: incremental, for streams; text that might
  still turn into a tag is held back until it is decided; a tool call streams as it is
  generated (a first fragment with id and name, then argument text);
- `parse(text) -> whole`: the non-streamed parse of a complete output (the tool parsers run
  their stream machine over the whole text: parsers/streaming.py).
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI stream fragment of a tool call: the first of a call carries id and name,
    later ones carry argument text to append."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # The logprobs of the tokens fed with this text, passed through untouched: holding text
    # back must never drop (or move) the logprobs of the tokens that produced it.
    logprobs: list[Any] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls or self.logprobs)


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def held_prefix_len(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag` (text that
    may still become the tag, so it must not be emitted yet)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits raw output into (reasoning, rest). Subclasses implement the three methods."""

    needs_special_tokens = False

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, str]:
        raise NotImplementedError


class ToolParser:
    """Splits (non-reasoning) output into content and tool calls."""

    # The parser's markers are special tokens: the text it reads must keep them
    # (skip_special_tokens off for the requests it parses).
    needs_special_tokens = False

    default_id: Callable[[], str] = staticmethod(new_tool_call_id)

    def __init__(self, allowed_names: set[str] | None = None,
                 id_factory: Callable[[], str] | None = None,
                 schemas: dict[str, Any] | None = None) -> None:
        self.allowed_names = allowed_names
        self.new_id = id_factory or self.default_id
        self.schemas = schemas or {}   # tool name -> its `parameters` JSON Schema (XML formats)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    # -- shared helpers ----------------------------------------------------------------------
    def call_from_json(self, obj: Any) -> tuple[str, str] | None:
        """(name, arguments JSON) of a well-formed call object, else None (-> content)."""
        import json
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return None
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        if self.allowed_names is not None and name not in self.allowed_names:
            return None
        return name, json.dumps(args, ensure_ascii=False)


class OutputParser:
    """Reasoning parser, then tool parser on what is not reasoning. Either may be absent."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    @property
    def num_tool_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def _split(self, reasoning_and_rest: tuple[str, str], final: bool,
               logprobs: Sequence[Any]) -> ParsedDelta:
        reasoning, rest = reasoning_and_rest
        out = ParsedDelta(reasoning=reasoning, logprobs=list(logprobs))
        if self.tools is None:
            out.content = rest
            return out
        content, calls = self.tools.feed(rest) if rest else ("", [])
        if final:
            more, more_calls = self.tools.finish()
            content, calls = content + more, calls + more_calls
        out.content, out.tool_calls = content, calls
        return out

    def feed(self, text: str, logprobs: Sequence[Any] = ()) -> ParsedDelta:
        split = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._split(split, False, logprobs)

    def finish(self, logprobs: Sequence[Any] = ()) -> ParsedDelta:
        split = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._split(split, True, logprobs)

    def parse(self, text: str) -> ParsedOutput:
        reasoning, rest = self.reasoning.parse(text) if self.reasoning is not None else ("", text)
        if self.tools is None:
            return ParsedOutput(reasoning, rest)
        content, calls = self.tools.parse(rest)
        return ParsedOutput(reasoning, content, calls)
