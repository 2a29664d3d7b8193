"""schemathesis against the gateway's own OpenAPI document (GET /openapi.json, request bodies
from the validating pydantic models): generated valid and invalid requests to every operation
never get a 5xx and never hang, and the gateway still serves afterwards."""
from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

MAX_EXAMPLES = 10     # per operation and mode: bounded for CI
MAX_NEW_TOKENS = 4    # generation stays short (null max_tokens would run to the context length)
GENERATING = {"/v1/completions", "/v1/chat/completions", "/invocations", "/v1/responses",
              "/v1/messages"}


@pytest.fixture(scope="module")
def gateway_schema(mesh):
    return schemathesis.openapi.from_url(f"{mesh.http_url}/openapi.json")


def _bound_generation(case) -> None:
    """Keep every generated completion short: a missing, null or large max_tokens (or
    max_completion_tokens) becomes small; ill-typed values stay, they must be a 400."""
    if case.path not in GENERATING or not isinstance(case.body, dict):
        return
    body = case.body
    fields = (("max_output_tokens",) if case.path == "/v1/responses"
              else ("max_tokens", "max_completion_tokens"))
    for field in fields:
        value = body.get(field)
        if field in body and (value is None or (type(value) is int and value > MAX_NEW_TOKENS)):
            body[field] = MAX_NEW_TOKENS
    if all(body.get(field) is None for field in fields):
        body[fields[0]] = MAX_NEW_TOKENS


def test_the_openapi_document_describes_the_request_bodies(mesh):
    doc = requests.get(f"{mesh.http_url}/openapi.json", timeout=30).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
    for path in ("/v1/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize",
                 "/invocations", "/v1/messages", "/v1/messages/count_tokens"):
        assert "requestBody" in doc["paths"][path]["post"], path


# schemathesis.pytest.from_fixture (the lazy loader) breaks on pytest 9 (it sets
# `item._nodeid`, which pytest 9 removed), so each operation's strategy is driven directly.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_generated_requests_never_get_a_5xx_or_hang(gateway_schema, mode):
    operations = [result.ok() for result in gateway_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    for op in operations:
        if mode is GenerationMode.NEGATIVE and not op.get_request_payload_content_types():
            continue  # no body: a GET's path or nothing at all cannot be made schema-invalid
        @given(case=op.as_strategy(mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def never_5xx(case):
            _bound_generation(case)
            response = case.call(timeout=60)  # a hang fails here
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        never_5xx()


def test_the_gateway_still_serves_after_schemathesis(mesh):
    r = requests.post(f"{mesh.http_url}/v1/completions", timeout=60,
                      json={"model": mesh.model_name, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert requests.get(f"{mesh.http_url}/health", timeout=10).status_code == 200
