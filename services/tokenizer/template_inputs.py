"""What a request may add to a chat-template render: tools, tool messages, extra kwargs.

Everything here arrives as client JSON, so it is checked before it reaches the template:
extra kwargs may never shadow a variable or global the render itself sets (a request must
not swap `messages`, `bos_token` or `raise_exception`), and every value is plain JSON."""
from __future__ import annotations

import json
import re
from typing import Any

from services.tokenizer.template_sandbox import ChatTemplateError

# Names the render or the sandbox defines; a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now", "dict", "namespace",
    "range", "lipsum", "cycler", "joiner", "tojson", "loop", "self", "caller", "varargs",
    "kwargs", "true", "false", "none", "True", "False", "None", "chat_template", "tokenize",
    "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer",
})
_KWARG_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
MAX_KWARGS = 32
MAX_JSON_CHARS = 256_000


def _load_json(text: str, what: str) -> Any:
    if len(text) > MAX_JSON_CHARS:
        raise ChatTemplateError(f"{what} is too large: {len(text)} chars > {MAX_JSON_CHARS}")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ChatTemplateError(f"{what} is not valid JSON: {e}") from None


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """The request's chat_template_kwargs (a JSON object), refusing reserved names."""
    if not text:
        return {}
    kwargs = _load_json(text, "chat_template_kwargs")
    if not isinstance(kwargs, dict):
        raise ChatTemplateError("chat_template_kwargs must be a JSON object")
    if len(kwargs) > MAX_KWARGS:
        raise ChatTemplateError(f"chat_template_kwargs has too many keys: {len(kwargs)} > {MAX_KWARGS}")
    for key in kwargs:
        if not _KWARG_NAME.match(key):
            raise ChatTemplateError(f"chat_template_kwargs key {key!r} is not a plain name "
                                    "(letters, digits, underscores; starts with a letter)")
        if key in RESERVED_TEMPLATE_NAMES:
            raise ChatTemplateError(f"chat_template_kwargs may not set {key!r}: the server "
                                    "sets it itself")
    return kwargs


def parse_tools(text: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tools` list (as JSON) for the template, or None."""
    if not text:
        return None
    tools = _load_json(text, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("tools must be a JSON list of objects")
    return tools or None


def tool_calls_for_template(text: str, index: int) -> list[dict[str, Any]]:
    """Assistant tool calls as templates expect them: `arguments` as an object when it is a
    JSON object string (transformers' convention, as vLLM does), else left as given."""
    calls = _load_json(text, f"messages[{index}].tool_calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ChatTemplateError(f"messages[{index}].tool_calls must be a list of objects")
    out = []
    for call in calls:
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            fn = dict(fn)
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
            if isinstance(args, dict):
                fn["arguments"] = args
            call["function"] = fn
        out.append(call)
    return out
