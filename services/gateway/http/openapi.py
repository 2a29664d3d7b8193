"""The gateway's OpenAPI document (GET /openapi.json), with request-body schemas.

The POST routes read the raw body themselves (so body_guard.py can bound size, encoding and
nesting before anything is parsed) and only then validate it with the pydantic models. FastAPI
therefore never sees those models; this module puts their JSON Schemas into the document, so
clients and fuzzers (schemathesis, tests/integration/test_security_schemathesis.py) know the
real request shapes. The schemas are the validating models themselves: no second copy to drift."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.common.sampling_rules import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N
from services.common.structured import MAX_CHOICES
from services.gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from services.gateway.http.admin import DrainBody
from services.gateway.embeddings import EmbeddingRequest
from services.gateway.http.invocations import InvocationRequest
from services.gateway.http.tokenize import DetokenizeRequest, TokenizeRequest
from services.gateway.openai.protocol import (MAX_BATCH_PROMPTS, ChatCompletionRequest,
                                              CompletionRequest)
from services.gateway.openai.responses_protocol import ResponsesInputTokensRequest, ResponsesRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest,                      # Anthropic (docs/api_anthropic.md)
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/responses/input_tokens": ResponsesInputTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/drain": DrainBody,   # admin
    # One of the bodies above (refs to their refined schemas, so it comes after them).
    "/invocations": InvocationRequest,
}

# What every POST may answer besides 200 (docs/security.md lists the limits behind them).
_ERRORS = {"400": "invalid request (names the field)", "401": "missing or wrong API key",
           "404": "unknown model", "413": "body over the size or decompression limit",
           "415": "unsupported Content-Encoding", "429": "admission limit reached (Retry-After)",
           "503": "not ready (Retry-After)"}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_STRINGS = {"type": "array", "items": {"type": "string"}}

# Fields the models type as Any and check in a validator (for a clearer message than
# pydantic's): their real shapes. Keyed by (model, field).
_SHAPES: dict[tuple[str, str], dict] = {
    ("CompletionRequest", "prompt"): {"anyOf": [
        {"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS,     # a batch of prompts
         "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS,
         "items": {**_TOKEN_IDS, "minItems": 1}}]},
    ("CompletionRequest", "stop"): {"anyOf": [{"type": "string"}, _STRINGS, {"type": "null"}]},
    ("ChatCompletionRequest", "stop"): {"anyOf": [{"type": "string"}, _STRINGS, {"type": "null"}]},
    ("MessagesRequest", "temperature"): {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1},
                                                   {"type": "null"}]},
    ("EmbeddingRequest", "input"): {"anyOf": [
        {"type": "string"}, {**_STRINGS, "minItems": 1}, {**_TOKEN_IDS, "minItems": 1},
        {"type": "array", "minItems": 1, "items": {**_TOKEN_IDS, "minItems": 1}}]},
}

# Ranges the gateway enforces (services/common/sampling_rules.py), added to the non-null alternative.
_BOUNDS: dict[str, dict] = {
    "max_tokens": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
    "max_output_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0}, "messages": {"minItems": 1},
    "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1}, "top_k": {"minimum": -1},
    "presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "n": {"minimum": 1, "maximum": MAX_N}, "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "seed": {"minimum": -(2**63), "maximum": 2**63 - 1},
    "priority": {"minimum": -(2**31), "maximum": 2**31 - 1},
    "cache_salt": {"maxLength": MAX_CACHE_SALT_CHARS, "pattern": "^[A-Za-z0-9._:@/+=-]*$"},
    "guided_choice": {"minItems": 1, "maxItems": MAX_CHOICES},
    "logit_bias": {"maxProperties": MAX_LOGIT_BIAS,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
}
_INT_LOGPROBS = {"minimum": 0, "maximum": MAX_LOGPROBS}  # completions' logprobs (chat's is a bool)
# The nested request models (components) with the same kind of bounds: structured_outputs names
# one constraint (the others absent), a choice list is 1..MAX_CHOICES strings.
_NESTED_BOUNDS: dict[str, dict[str, dict]] = {
    "StructuredOutputsIn": {"choice": {"minItems": 1, "maxItems": MAX_CHOICES}},
}
_NESTED_SHAPES: dict[str, dict] = {"StructuredOutputsIn": {"minProperties": 1, "maxProperties": 1}}


def _refine(name: str, schema: dict) -> None:
    """Tighten one model's generated JSON Schema to what the gateway really accepts."""
    for field, prop in schema.get("properties", {}).items():
        if (name, field) in _SHAPES:
            keep = {k: prop[k] for k in ("default", "title") if k in prop}
            prop.clear()
            prop.update(_SHAPES[(name, field)], **keep)
            continue
        bounds = _INT_LOGPROBS if (name, field) == ("CompletionRequest", "logprobs") else _BOUNDS.get(field)
        if bounds is None:
            continue
        for alt in prop.get("anyOf", [prop]):
            if alt.get("type") in ("integer", "number", "string", "object", "array"):
                alt.update(bounds)


def _bound(schema: dict, bounds: dict[str, dict]) -> None:
    for field, prop in schema.get("properties", {}).items():
        for alt in prop.get("anyOf", [prop]) if field in bounds else ():
            if alt.get("type") in ("integer", "number", "string", "object", "array"):
                alt.update(bounds[field])


def _error_schema() -> dict:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def build(app: FastAPI) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of meshllm (see docs/api.md)")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = _error_schema()
    error_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, model in REQUEST_BODIES.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        defs = schema.pop("$defs", {})
        for name, fields in _NESTED_BOUNDS.items():
            if name in defs:
                _bound(defs[name], fields)
                defs[name].update(_NESTED_SHAPES.get(name, {}))
        for name, schema_of_def in defs.items():   # a route's own (refined) schema stays
            schemas.setdefault(name, schema_of_def)
        _refine(model.__name__, schema)
        schemas[model.__name__] = schema
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for status, why in _ERRORS.items():
            op["responses"].setdefault(status, {"description": why, **error_ref})
    return doc


def install(app: FastAPI) -> None:
    """Serve the document above at app.openapi_url (built once, on first request)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema
    app.openapi = openapi
