"""Send one benchmark request and time its stream: OpenAI completions / chat over HTTP SSE,
or meshllm's gRPC Generate. Each returns a RequestResult and never raises for a failed request."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from services.benchmark.datasets import SampleRequest, messages_as_text
from services.benchmark.http_client import ConnectError, HttpClient, HttpStatusError
from services.benchmark.metrics import RequestResult

BACKENDS = ("openai", "openai-chat", "meshllm-grpc")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestOptions:
    model: str
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict | None = None


def error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI error body, else the body itself (shortened)."""
    try:
        err = json.loads(body)
        msg = err.get("error", err)
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
        return str(msg)[:300]
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace")


class OpenAIBackend:
    """Streams /v1/completions (`openai`) or /v1/chat/completions (`openai-chat`)."""

    def __init__(self, base_url: str, endpoint: str, chat: bool, opts: RequestOptions,
                 api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = HttpClient(base_url, headers=headers)
        self.endpoint, self.chat, self.opts = endpoint, chat, opts

    def _body(self, req: SampleRequest) -> bytes:
        body = {"model": self.opts.model, "max_tokens": req.output_len, "temperature": self.opts.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt if req.prompt is not None else messages_as_text(req.messages)
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        if self.opts.extra_body:
            body.update(self.opts.extra_body)
        return json.dumps(body).encode()

    async def send(self, req: SampleRequest) -> RequestResult:
        res = RequestResult(prompt_len=req.prompt_len)
        body = self._body(req)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(body, res, t0), self.opts.timeout_s)
        except HttpStatusError as exc:
            res.error, res.error_message = f"http_{exc.status}", error_message(exc.body)
        except _StreamError as exc:
            res.error, res.error_message = exc.kind, exc.message
        except ConnectError as exc:
            res.error, res.error_message = "connect", str(exc)
        except asyncio.TimeoutError:
            res.error, res.error_message = "timeout", f"no complete response in {self.opts.timeout_s:.0f}s"
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            res.error, res.error_message = "stream", f"{type(exc).__name__}: {exc}"
        return res

    async def _stream(self, body: bytes, res: RequestResult, t0: float) -> None:
        buf = b""
        last = 0.0
        chunks = 0
        usage = None
        content_key = "delta" if self.chat else "text"
        async for data in self.http.post_stream(self.endpoint, body):
            buf += data
            *events, buf = buf.split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                if not ev.startswith(b"data: "):
                    continue
                payload = ev[6:]
                if payload == b"[DONE]":
                    continue
                msg = json.loads(payload)
                if "error" in msg and "choices" not in msg:
                    err = msg["error"]
                    raise _StreamError(err.get("type") or "stream_error",
                                       err.get("message", "") if isinstance(err, dict) else str(err))
                if msg.get("usage"):
                    usage = msg["usage"]
                choices = msg.get("choices")
                if not choices:
                    continue
                c = choices[0]
                text = c.get("delta", {}).get("content") if content_key == "delta" else c.get("text")
                if not text:
                    continue
                if chunks == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.latency = time.perf_counter() - t0
        if chunks == 0:
            raise _StreamError("empty", "the stream carried no tokens")
        res.output_len = usage["completion_tokens"] if usage else chunks
        if usage and usage.get("prompt_tokens"):
            res.prompt_len = usage["prompt_tokens"]
        res.success = True

    async def close(self) -> None:
        await self.http.close()


class _StreamError(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class GrpcBackend:
    """meshllm's public gRPC API: Generation.Generate (server stream, one message per step)."""

    def __init__(self, address: str, opts: RequestOptions) -> None:
        import grpc

        from services.common import pb
        self.pb, self.grpc, self.opts = pb, grpc, opts
        self.channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"),
                                                 options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb.generation_grpc.GenerationStub(self.channel)

    def _request(self, req: SampleRequest):
        pb = self.pb
        sampling = pb.common.SamplingParams(max_tokens=req.output_len, temperature=self.opts.temperature,
                                            ignore_eos=self.opts.ignore_eos, skip_special_tokens=True)
        g = pb.generation.GenerateRequest(model=self.opts.model, sampling=sampling)
        if req.messages:
            g.chat.messages.extend(pb.common.ChatMessage(role=m["role"], content=m["content"])
                                   for m in req.messages)
        else:
            g.text = req.prompt
        return g

    async def send(self, req: SampleRequest) -> RequestResult:
        res = RequestResult(prompt_len=req.prompt_len)
        t0 = time.perf_counter()
        last, chunks, n_tokens = 0.0, 0, 0
        try:
            call = self.stub.Generate(self._request(req), timeout=self.opts.timeout_s)
            async for msg in call:
                now = time.perf_counter()
                if msg.token_ids:
                    n_tokens += len(msg.token_ids)
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                if msg.HasField("usage") and msg.usage.completion_tokens:
                    res.output_len = msg.usage.completion_tokens
                    res.prompt_len = msg.usage.prompt_tokens or res.prompt_len
        except self.grpc.aio.AioRpcError as err:
            code = err.code()
            res.error = "connect" if code == self.grpc.StatusCode.UNAVAILABLE else f"grpc_{code.name.lower()}"
            res.error_message = err.details() or code.name
            return res
        res.latency = time.perf_counter() - t0
        if chunks == 0:
            res.error, res.error_message = "empty", "the stream carried no tokens"
            return res
        res.output_len = res.output_len or n_tokens
        res.success = True
        return res

    async def close(self) -> None:
        await self.channel.close()


def make_backend(name: str, base_url: str, endpoint: str | None, opts: RequestOptions,
                 api_key: str | None = None):
    if name == "meshllm-grpc":
        return GrpcBackend(base_url, opts)
    return OpenAIBackend(base_url, endpoint or DEFAULT_ENDPOINTS[name], name == "openai-chat", opts, api_key)
