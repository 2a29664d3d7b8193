"""A battery of JSON schemas for the structured-output tests through a running mesh (async
scheduling on: test_structured_outputs.py; off, with chunked prefill: test_scheduler_flags.py).
Every schema is bounded (string lengths, array sizes, enums, ranges), so a constrained greedy
SmolLM2 output completes well inside max_tokens and must parse and validate."""
from __future__ import annotations

import json

SCHEMAS = {
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"id": {"anyOf": [
        {"type": "integer", "minimum": 1, "maximum": 999}, {"type": "string", "pattern": "^[a-z]{3}$"}]}},
        "required": ["id"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                 "ref": {"type": "string", "format": "uuid"}},
                "required": ["day", "ref"], "additionalProperties": False},
    "ranges": {"type": "object", "properties": {"count": {"type": "integer", "minimum": -5, "maximum": 5},
                                                "ok": {"type": "boolean"},
                                                "note": {"type": ["string", "null"], "maxLength": 10}},
               "required": ["count", "ok", "note"], "additionalProperties": False},
}


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with one JSON object ({name}).'"}]


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check(name: str, text: str, finish_reason: str) -> None:
    import jsonschema
    assert finish_reason == "stop", (name, finish_reason, text)
    jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker())


def run_whole(client, model: str, name: str, n: int = 2, max_tokens: int = 160) -> int:
    """One request with n choices (the first greedy, the rest sampled: temperature 0.8, seeded);
    -> how many choices were checked."""
    r = client.chat.completions.create(model=model, messages=ask(name), response_format=response_format(name),
                                       n=n, temperature=0.8, seed=11, max_tokens=max_tokens)
    for c in r.choices:
        check(name, c.message.content, c.finish_reason)
    return len(r.choices)


def run_streamed(client, model: str, name: str, n: int = 2, max_tokens: int = 160) -> int:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=ask(name), stream=True, n=n,
                                                response_format=response_format(name), temperature=0.8,
                                                seed=12, max_tokens=max_tokens):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    for i, text in texts.items():
        check(name, text, reasons.get(i, ""))
    return len(texts)
