"""OpenAI response bodies and SSE chunks (plain dicts, as the official client expects)."""
from __future__ import annotations

import json



def usage(handle) -> dict:
    """OpenAI usage of a RequestHandle or a ChoiceGroup (each prompt counted once). The shape
    never depends on the cache: prompt_tokens_details.cached_tokens is always there (0 when
    nothing was cached; the count is the engine's, OutputBatch.num_cached_tokens)."""
    return {"prompt_tokens": handle.num_prompt_tokens,
            "completion_tokens": handle.num_completion_tokens,
            "total_tokens": handle.num_prompt_tokens + handle.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": handle.num_cached_tokens}}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
