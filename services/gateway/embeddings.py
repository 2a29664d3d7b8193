"""Embeddings for both public APIs: POST /v1/embeddings (OpenAI shape) and gRPC
Generation.Embed. Validation is shared; the embedder service does the tokenization
(it owns the embedding model's tokenizer) and the forward passes.

OpenAI `input`: a string, a list of strings, a list of token ids, or a list of lists of
token ids. Token ids are embedded as they are (no [CLS]/[SEP] added), like vLLM.
"""
from __future__ import annotations

import base64
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from services.common import pb
from services.gateway.clients.embedder import EmbedderClient
from services.gateway.errors import ApiError, invalid
from services.gateway.ids import new_request_id, sane_client_id
from services.gateway.openai.protocol import parse_body

log = logging.getLogger("meshllm.gateway.embeddings")

_INT32_MAX = 2**31 - 1


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # unknown fields: a 400 naming them

    input: Any                       # required; shape checked in openai_inputs()
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None   # extra body (vLLM): -1 = the context length


def _is_token(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_item(ids: list, where: str) -> pb.embed.EmbedItem:
    if not all(_is_token(t) for t in ids):
        raise invalid(f"{where} must contain only integer token ids", "input")
    if any(not 0 <= t <= _INT32_MAX for t in ids):
        raise invalid(f"{where} contains a negative or too large token id", "input")
    return pb.embed.EmbedItem(token_ids=pb.common.TokenIds(ids=ids))


def openai_inputs(value: Any) -> list[pb.embed.EmbedItem]:
    """OpenAI's `input` as embedder items (emptiness is checked later, for both APIs)."""
    if isinstance(value, str):
        return [pb.embed.EmbedItem(text=value)]
    if not isinstance(value, list):
        raise invalid("input must be a string, a list of strings, a list of token ids or a "
                      "list of lists of token ids", "input")
    if value and all(isinstance(v, str) for v in value):
        return [pb.embed.EmbedItem(text=v) for v in value]
    if value and all(_is_token(v) for v in value):
        return [_token_item(value, "input")]
    if value and all(isinstance(v, list) for v in value):
        return [_token_item(v, f"input[{i}]") for i, v in enumerate(value)]
    if not value:
        return []
    raise invalid("input must be a string, a list of strings, a list of token ids or a list "
                  "of lists of token ids (not a mix)", "input")


def grpc_inputs(inputs) -> list[pb.embed.EmbedItem]:
    items = []
    for i, item in enumerate(inputs):
        which = item.WhichOneof("input")
        if which == "text":
            items.append(pb.embed.EmbedItem(text=item.text))
        elif which == "token_ids":
            items.append(pb.embed.EmbedItem(token_ids=item.token_ids))
        else:
            raise invalid(f"inputs[{i}] must set text or token_ids", "inputs")
    return items


@dataclass
class EmbedResult:
    model: str
    vectors: np.ndarray        # [num_inputs, dimensions] float32
    prompt_tokens: int


class Embeddings:
    """The gateway's embeddings front: which model serves them, limits, and the call.

    `client` is None when the gateway runs without an embedder (--embedder-addr unset)."""

    def __init__(self, client: EmbedderClient | None, generation_model: str) -> None:
        self.client = client
        self.generation_model = generation_model

    async def _known_info(self) -> pb.embed.EmbedderInfo | None:
        """The embedder's info if it is reachable (asked at most briefly), else None."""
        if self.client is None:
            return None
        if self.client.info is None:
            with contextlib.suppress(ApiError):
                await self.client.get_info(timeout_s=0.5)
        return self.client.info

    async def model_cards(self, created: int, model: str | None = None) -> list[dict]:
        """The embedding model's card for /v1/models (none while the embedder is unreachable);
        with `model`, only if that is its name."""
        info = await self._known_info()
        if info is None or model not in (None, info.model_name):
            return []
        return [{"id": info.model_name, "object": "model", "created": created,
                 "owned_by": "meshllm", "root": info.model_name,
                 "max_model_len": info.max_model_len}]

    async def grpc_model_cards(self, created: int) -> list["pb.generation.ModelCard"]:
        return [pb.generation.ModelCard(id=c["id"], created=created, owned_by="meshllm",
                                        max_model_len=c["max_model_len"])
                for c in await self.model_cards(created)]

    async def _info(self, model: str | None) -> pb.embed.EmbedderInfo:
        if self.client is None:
            raise ApiError("not_found", f"The model `{model or 'default'}` does not exist: this "
                           "server has no embedding model (start it with --embedding-model, "
                           "or the gateway with --embedder-addr)", param="model",
                           code="model_not_found")
        info = await self.client.get_info()
        if model and model != info.model_name:
            if model == self.generation_model:
                raise invalid(f"The model `{model}` generates text and does not serve "
                              f"embeddings; use `{info.model_name}`", "model")
            raise ApiError("not_found", f"The model `{model}` does not exist; the embedding "
                           f"model is `{info.model_name}`", param="model", code="model_not_found")
        return info

    async def embed(self, model: str | None, items: list[pb.embed.EmbedItem], *,
                    dimensions: int | None, truncate: int | None,
                    request_id: str) -> EmbedResult:
        """Validate and embed; raises ApiError (400 / 404 / 429 / 503) for the caller to render."""
        start = time.perf_counter()
        info = await self._info(model)
        if not items:
            raise invalid("input must not be empty", "input")
        if len(items) > info.max_items_per_request:
            raise invalid(f"too many inputs: {len(items)}; at most "
                          f"{info.max_items_per_request} per request", "input")
        for i, item in enumerate(items):
            if item.WhichOneof("input") == "text" and not item.text:
                raise invalid(f"input[{i}] is an empty string", "input")
            if item.WhichOneof("input") == "token_ids" and not item.token_ids.ids:
                raise invalid(f"input[{i}] is an empty list of token ids", "input")
        if dimensions is not None and dimensions != info.dimensions:
            raise invalid(f"dimensions={dimensions} is not supported by `{info.model_name}`: "
                          f"its embeddings have {info.dimensions} dimensions", "dimensions")
        request = pb.embed.EmbedBatchRequest(items=items, request_id=request_id)
        if truncate is not None:
            if truncate != -1 and not 1 <= truncate <= info.max_model_len:
                raise invalid(f"truncate_prompt_tokens must be -1 or in [1, "
                              f"{info.max_model_len}], got {truncate}", "truncate_prompt_tokens")
            request.truncate_prompt_tokens = truncate
        resp = await self.client.embed(request)
        if len(resp.embeddings) != len(items):
            raise ApiError("internal", "the embedder answered a malformed response")
        vectors = np.array([e.values for e in resp.embeddings], dtype=np.float32)
        tokens = sum(e.num_tokens for e in resp.embeddings)
        log.info("embed id=%s inputs=%d prompt_tokens=%d ms=%.1f", request_id, len(items),
                 tokens, (time.perf_counter() - start) * 1e3)
        return EmbedResult(info.model_name, vectors, tokens)

    # --- the two APIs --------------------------------------------------------------------

    async def create_openai(self, body: bytes, request_id: str) -> dict:
        """POST /v1/embeddings: the request body -> the OpenAI response body."""
        req = parse_body(EmbeddingRequest, body)
        if req.encoding_format not in ("float", "base64"):
            raise invalid(f"encoding_format must be 'float' or 'base64', got "
                          f"{req.encoding_format!r}", "encoding_format")
        if req.dimensions is not None and req.dimensions < 1:
            raise invalid(f"dimensions must be at least 1, got {req.dimensions}", "dimensions")
        result = await self.embed(req.model, openai_inputs(req.input), dimensions=req.dimensions,
                                  truncate=req.truncate_prompt_tokens, request_id=request_id)
        if req.encoding_format == "base64":
            # OpenAI's base64: the raw little-endian float32 bytes of each vector.
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                    for v in result.vectors]
        else:
            data = result.vectors.tolist()
        return {"object": "list", "model": result.model,
                "data": [{"object": "embedding", "index": i, "embedding": e}
                         for i, e in enumerate(data)],
                "usage": {"prompt_tokens": result.prompt_tokens,
                          "total_tokens": result.prompt_tokens}}

    async def create_grpc(self, request: "pb.generation.EmbedRequest",
                          request_id: str) -> "pb.generation.EmbedResponse":
        truncate = (request.truncate_prompt_tokens
                    if request.HasField("truncate_prompt_tokens") else None)
        if request.dimensions < 0:
            raise invalid(f"dimensions must be >= 0 (0 = native), got {request.dimensions}",
                          "dimensions")
        result = await self.embed(request.model, grpc_inputs(request.inputs),
                                  dimensions=request.dimensions or None, truncate=truncate,
                                  request_id=request_id)
        return pb.generation.EmbedResponse(
            request_id=request_id, model=result.model,
            embeddings=[pb.generation.Embedding(index=i, values=v)
                        for i, v in enumerate(result.vectors.tolist())],
            usage=pb.common.Usage(prompt_tokens=result.prompt_tokens,
                                  total_tokens=result.prompt_tokens))


async def grpc_embed(embeddings: Embeddings, request: "pb.generation.EmbedRequest",
                     context) -> "pb.generation.EmbedResponse":
    """Generation.Embed: the same validation as HTTP, errors as gRPC statuses."""
    rid = request.request_id or new_request_id("embd")
    try:
        if sane_client_id(rid) is None:
            raise invalid("request_id must be 1-128 characters of [A-Za-z0-9._:@/+=-]",
                          "request_id")
        return await embeddings.create_grpc(request, rid)
    except ApiError as err:
        log.info("embed id=%s route=grpc outcome=error:%s", rid, err.kind)
        await err.abort_grpc(context)
