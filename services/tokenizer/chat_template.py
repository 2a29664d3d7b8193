"""Chat templates rendered like transformers' `apply_chat_template`, with limits.

`ChatTemplate(source, special_tokens).render(messages, add_generation_prompt=...,
continue_final_message=...)` returns the prompt text. Every failure (bad messages,
template errors, `raise_exception`, sandbox violations, time/size limits) is a
`ChatTemplateError`, i.e. bad input for the caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from services.tokenizer.template_sandbox import (ChatTemplateError, GuardedEnvironment,
                                                 RenderDeadline, RenderLimitError, RenderLimits,
                                                 check_deadline)

__all__ = ["ALLOWED_ROLES", "ChatTemplate", "ChatTemplateError", "MessageLimits",
           "RenderLimitError", "RenderLimits", "validate_messages"]

ALLOWED_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# transformers' marker: appended to the final message, rendered, then cut off again.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class MessageLimits:
    max_messages: int = 4096
    max_chars: int = 1_000_000   # total role+content+name chars over all messages

    def __post_init__(self) -> None:
        if self.max_messages <= 0 or self.max_chars <= 0:
            raise ValueError(f"message limits must be positive: {self}")


def validate_messages(messages: list[dict[str, Any]], limits: MessageLimits = MessageLimits()) -> None:
    """Raise ChatTemplateError unless `messages` is a non-empty list of {role, content[, name]}."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if len(messages) > limits.max_messages:
        raise ChatTemplateError(f"too many messages: {len(messages)} > {limits.max_messages}")
    total = 0
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ALLOWED_ROLES:
            raise ChatTemplateError(
                f"messages[{i}].role must be one of {sorted(ALLOWED_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")
        name = message.get("name", "")
        if not isinstance(name, str):
            raise ChatTemplateError(f"messages[{i}].name must be a string")
        if not isinstance(message.get("tool_calls", []), list):
            raise ChatTemplateError(f"messages[{i}].tool_calls must be a list")
        if not isinstance(message.get("tool_call_id", ""), str):
            raise ChatTemplateError(f"messages[{i}].tool_call_id must be a string")
        total += len(role) + len(content) + len(name)
    if total > limits.max_chars:
        raise ChatTemplateError(f"messages too long: {total} chars > {limits.max_chars}")


class ChatTemplate:
    """One compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 limits: RenderLimits = RenderLimits(),
                 message_limits: MessageLimits = MessageLimits()) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template is empty")
        self.source = source
        self.limits = limits
        self.message_limits = message_limits
        # bos_token / eos_token / unk_token / pad_token, as transformers passes special_tokens_map.
        self.special_tokens = dict(special_tokens or {})
        self._env = GuardedEnvironment(limits)
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
               extra: dict[str, Any] | None = None) -> str:
        """`extra`: the request's chat_template_kwargs, already checked against the
        reserved names (template_inputs.parse_template_kwargs); they never override ours."""
        validate_messages(messages, self.message_limits)
        messages = [dict(m) for m in messages]  # the tag edit below must not touch the caller's
        final_content = ""
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message and add_generation_prompt cannot both be set")
            if "content" not in self.source:
                raise ChatTemplateError(
                    "continue_final_message is set but the chat template does not use 'content'")
            final_content = messages[-1]["content"]
            messages[-1]["content"] = final_content + _CONTINUE_TAG
        variables = {**(extra or {}), **self.special_tokens, "messages": messages,
                     "tools": tools or None, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        rendered = self._render_capped(variables)
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, final_content)
        return rendered

    def _render_capped(self, variables: dict[str, Any]) -> str:
        """Stream the template's output, stopping once it passes the size or time cap."""
        cap = self.limits.max_chars
        parts: list[str] = []
        size = 0
        try:
            with RenderDeadline(self.limits.max_render_s):
                chunks = self._template.generate(**variables)
                try:
                    for chunk in chunks:
                        size += len(chunk)
                        if size > cap:
                            raise RenderLimitError(f"rendered chat prompt is over {cap} chars")
                        check_deadline()
                        parts.append(chunk)
                finally:
                    chunks.close()
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
        except jinja2.TemplateError as e:  # includes raise_exception(...) from the template
            raise ChatTemplateError(f"chat template error: {e}") from None
        except RecursionError:
            raise RenderLimitError("chat template recursed too deeply") from None
        except MemoryError:
            raise RenderLimitError("chat template ran out of memory") from None
        except Exception as e:  # a template bug over these messages is still bad input
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        return "".join(parts)


def _cut_after_final_message(rendered: str, final_content: str) -> str:
    """transformers' continue_final_message: keep the text up to the final message's end."""
    tag = _CONTINUE_TAG.strip()
    if final_content.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message is set but the chat template does not "
                                "render the final message's content")
    loc = rendered.rindex(tag)
    if rendered[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    # The template trimmed the message's trailing whitespace, so trim ours too.
    return rendered[:loc].rstrip()
