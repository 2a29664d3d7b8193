"""OpenAI response bodies and SSE chunks (plain dicts, as the official client expects)."""
from __future__ import annotations

import json



def usage(handle) -> dict:
    """OpenAI usage of a RequestHandle or a ChoiceGroup (prompt counted once)."""
    out = {"prompt_tokens": handle.num_prompt_tokens,
           "completion_tokens": handle.num_completion_tokens,
           "total_tokens": handle.num_prompt_tokens + handle.num_completion_tokens}
    if handle.num_cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": handle.num_cached_tokens}
    return out


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
