"""Bounded input against the real mesh: each hostile request gets the right 4xx, and then
the gateway and the engine still answer a normal request and readiness stays true."""
from __future__ import annotations

import gzip
import json
import socket
import struct
import threading
import time
import zlib

import httpx
import pytest
import zstandard

MAX_BODY = 4 * 1024 * 1024  # the gateway's default --max-body-bytes


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
        yield c


def gateway_pid(mesh) -> int:
    for pid in mesh.service_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"services.gateway" in f.read():
                return pid
    raise RuntimeError("no gateway process")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def assert_still_serving(http, mesh) -> None:
    r = http.post("/v1/completions", json={"model": mesh.model_name, "prompt": "Hello",
                                           "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    assert http.get("/health").status_code == 200


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param, err


def chat(mesh, **kw) -> dict:
    return {"model": mesh.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, **kw}


def completion(mesh, **kw) -> dict:
    return {"model": mesh.model_name, "prompt": "hi", "max_tokens": 1, **kw}


# --- body size and Content-Encoding ---------------------------------------------------------

def test_body_over_the_limit_is_a_413(http, mesh):
    r = http.post("/v1/completions", content=b" " * (MAX_BODY + 1),
                  headers={"content-type": "application/json"})
    assert_error(r, 413, "larger than")
    assert_still_serving(http, mesh)


@pytest.mark.parametrize("encoding,compress", [
    ("gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),        # raw deflate, as some clients send
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_compressed_bodies_are_decompressed(http, mesh, encoding, compress):
    body = json.dumps(completion(mesh)).encode()
    r = http.post("/v1/completions", content=compress(body),
                  headers={"content-type": "application/json", "content-encoding": encoding})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def _gzip_of_zeros(total: int) -> bytes:
    """A gzip member of `total` zero bytes, built by repeating one fully flushed deflate
    block (compressing 10 GB for real would take minutes). The trailer's CRC is not
    computed: the gateway must stop long before reaching it."""
    step = 64 * 1024 * 1024
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(step)) + c.flush(zlib.Z_FULL_FLUSH)
    head = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return head + block * (total // step) + b"\x03\x00" + struct.pack("<II", 0, total % 2**32)


def _post_raw(port: int, headers: dict[str, str], body: bytes, chunked: bool) -> tuple[int, bytes]:
    """POST over a raw socket, sending in a thread (the server may answer before the body
    is all sent and then close); returns (status, response bytes)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += "transfer-encoding: chunked\r\n" if chunked else f"content-length: {len(body)}\r\n"
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\n{head}\r\n".encode())

    def send_body():
        try:
            for i in range(0, len(body), 64 * 1024):
                piece = body[i:i + 64 * 1024]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed early: expected

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 20:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
        sender.join(10)
    return int(data.split(b" ", 2)[1]), data


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_gzip_bomb_is_refused_with_413_and_memory_stays_flat(http, mesh, chunked):
    bomb = _gzip_of_zeros(10 * 1024 ** 3)          # ~10 MB that inflates to 10 GB
    assert 5e6 < len(bomb) < 20e6
    pid = gateway_pid(mesh)
    before = rss_bytes(pid)
    start = time.monotonic()
    status, response = _post_raw(mesh.http_port, {"content-type": "application/json",
                                                  "content-encoding": "gzip"}, bomb, chunked)
    assert status == 413, response[:300]
    assert time.monotonic() - start < 10
    grown = rss_bytes(pid) - before
    assert grown < 64 * 1024 * 1024, f"the gateway's RSS grew by {grown / 2**20:.0f} MiB"
    assert_still_serving(http, mesh)


def test_highly_compressed_body_under_the_size_limit_is_refused_by_the_ratio(http, mesh):
    body = json.dumps(completion(mesh, user=" " * (3 * 1024 * 1024))).encode()  # 3 MB -> ~3 KB
    r = http.post("/v1/completions", content=gzip.compress(body),
                  headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert_error(r, 413, "ratio")
    assert_still_serving(http, mesh)


def test_zstd_bomb_is_refused(http, mesh):
    bomb = zstandard.ZstdCompressor().compress(bytes(64 * 1024 * 1024))
    r = http.post("/v1/completions", content=bomb,
                  headers={"content-type": "application/json", "content-encoding": "zstd"})
    assert r.status_code == 413, r.text
    assert_still_serving(http, mesh)


@pytest.mark.parametrize("encoding,body,status", [
    ("br", b"whatever", 415),
    ("gzip", b"this is not gzip", 400),
    ("gzip", gzip.compress(b'{"prompt": "hi"}')[:-12], 400),   # truncated stream
])
def test_bad_content_encoding(http, mesh, encoding, body, status):
    r = http.post("/v1/completions", content=body,
                  headers={"content-type": "application/json", "content-encoding": encoding})
    assert_error(r, status)
    assert_still_serving(http, mesh)


# --- request fields --------------------------------------------------------------------------

def _deep(depth: int):
    v: object = 1
    for _ in range(depth):
        v = {"a": v}
    return v


HOSTILE = [
    ("n", "/v1/completions", lambda m: completion(m, n=17), "n"),
    ("n_huge", "/v1/completions", lambda m: completion(m, n=10 ** 9), "n"),
    ("logprobs", "/v1/completions", lambda m: completion(m, logprobs=21), "logprobs"),
    ("top_logprobs", "/v1/chat/completions", lambda m: chat(m, logprobs=True, top_logprobs=21),
     "top_logprobs"),
    ("stop_count", "/v1/completions", lambda m: completion(m, stop=["x"] * 33), "stop"),
    ("stop_length", "/v1/completions", lambda m: completion(m, stop=["x" * 513]), "stop"),
    ("logit_bias_size", "/v1/completions",
     lambda m: completion(m, logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    ("logit_bias_id", "/v1/completions",
     lambda m: completion(m, logit_bias={"10000000": 1}), "logit_bias"),
    ("stop_token_ids_count", "/v1/completions",
     lambda m: completion(m, stop_token_ids=list(range(65))), "stop_token_ids"),
    ("min_tokens_over_max", "/v1/completions",
     lambda m: completion(m, max_tokens=2, min_tokens=5), "min_tokens"),
    ("max_tokens_huge", "/v1/completions", lambda m: completion(m, max_tokens=10 ** 12),
     "max_tokens"),
    ("max_tokens_over_context", "/v1/completions", lambda m: completion(m, max_tokens=4000),
     "max_tokens"),
    ("tools_size", "/v1/chat/completions", lambda m: chat(m, tools=[
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 4000,
                                          "parameters": {}}} for i in range(100)]), "tools"),
    ("tools_depth", "/v1/chat/completions", lambda m: chat(m, tools=[
        {"type": "function", "function": {"name": "f", "parameters": _deep(40)}}]), "tools"),
    ("cache_salt_length", "/v1/completions", lambda m: completion(m, cache_salt="a" * 257),
     "cache_salt"),
    ("cache_salt_charset", "/v1/completions", lambda m: completion(m, cache_salt="a b\n"),
     "cache_salt"),
    ("priority_range", "/v1/completions", lambda m: completion(m, priority=2 ** 40), "priority"),
]


@pytest.mark.parametrize("path,make,param", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_out_of_range_fields_are_a_400_naming_the_field(http, mesh, path, make, param):
    r = http.post(path, json=make(mesh))
    assert_error(r, 400, param=param)
    assert_still_serving(http, mesh)


def test_json_nested_too_deep_is_a_400(http, mesh):
    body = b'{"prompt": "hi", "max_tokens": 1, "metadata": ' + b'{"a":' * 100 + b'1' + b'}' * 101
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, "deeper")
    assert_still_serving(http, mesh)


def test_invalid_utf8_is_a_400(http, mesh):
    body = b'{"prompt": "caf\xc3\x28", "max_tokens": 1}'
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, "utf-8")
    assert_still_serving(http, mesh)


@pytest.mark.parametrize("field,value", [
    ("chat_template", "{{ 7*7 }}"),          # vLLM accepts a request-level template: we don't
    ("tool_parser", "hermes"),
    ("attention_backend", "FLASH_ATTN"),
    ("device", "cuda:1"),
    ("guided_decoding_backend", "outlines"),
    ("sampler", "custom"),
    ("mm_processor_kwargs", {}),
])
def test_unknown_fields_that_would_select_internals_are_a_400_naming_them(http, mesh, field, value):
    r = http.post("/v1/chat/completions", json=chat(mesh, **{field: value}))
    assert_error(r, 400, field, param=field)
    r = http.post("/v1/completions", json=completion(mesh, **{field: value}))
    assert_error(r, 400, field, param=field)


def test_unknown_fields_on_tokenize_and_embeddings_are_a_400(http, mesh):
    assert_error(http.post("/tokenize", json={"prompt": "hi", "chat_template": "x"}), 400,
                 "chat_template")
    assert_error(http.post("/detokenize", json={"tokens": [1], "device": "x"}), 400, "device")
    assert_error(http.post("/v1/embeddings", json={"input": "hi", "pooling": "x"}), 400, "pooling")


def test_every_supported_extra_field_is_still_accepted(http, mesh):
    r = http.post("/v1/completions", json=completion(
        mesh, top_k=5, min_p=0.01, repetition_penalty=1.1, ignore_eos=True, min_tokens=1,
        stop_token_ids=[2], skip_special_tokens=True, include_stop_str_in_output=False,
        cache_salt="tenant-1", priority=0, echo=False, seed=1, user="u", n=1, best_of=1,
        presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"5": 1}, temperature=0.5,
        top_p=0.9, stop=["\n\n"], stream=False, suffix=None, logprobs=None,
        metadata={"k": "v"}, store=False, service_tier="auto"))
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json=chat(
        mesh, chat_template_kwargs={"x": 1}, add_generation_prompt=True,
        continue_final_message=False, max_completion_tokens=1, logprobs=True, top_logprobs=2,
        parallel_tool_calls=True, response_format={"type": "text"}, tool_choice="none",
        reasoning_effort="low", prompt_cache_key="k", safety_identifier="s", cache_salt="t"))
    assert r.status_code == 200, r.text
    r = http.post("/tokenize", json={"prompt": "hi", "return_token_strs": True,
                                     "add_special_tokens": True})
    assert r.status_code == 200, r.text
