"""Security building blocks without processes: body decoding limits, JSON depth, API keys,
CLI pass-through, and a scan of the tree for unsafe deserialization."""
from __future__ import annotations

import asyncio
import gzip
import os
import re
import zlib

import pytest
import zstandard

from services.gateway.guard.auth import ApiKeys, collect_keys
from services.gateway.guard.body_guard import BodyRejected, read_bounded
from services.gateway.errors import ApiError
from services.common.json_limits import json_depth_exceeds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _receive_from(data: bytes, chunk: int = 16 * 1024):
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)] or [b""]
    it = iter(enumerate(pieces))

    async def receive():
        i, piece = next(it)
        return {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
    return receive


def _read(data: bytes, encoding: str, limit: int = 1 << 20, ratio: float = 200.0) -> bytes:
    return asyncio.run(read_bounded(_receive_from(data), encoding, limit, ratio))


@pytest.mark.parametrize("encoding,compress", [
    ("identity", lambda b: b), ("gzip", gzip.compress), ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b))])
def test_each_encoding_round_trips(encoding, compress):
    payload = os.urandom(50_000) + b"x" * 100_000
    assert _read(compress(payload), encoding) == payload


@pytest.mark.parametrize("encoding,compress", [
    ("gzip", gzip.compress), ("deflate", zlib.compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b))])
def test_a_bomb_stops_at_the_output_limit(encoding, compress):
    with pytest.raises(BodyRejected) as info:
        _read(compress(bytes(64 << 20)), encoding, limit=1 << 20, ratio=1e9)
    assert info.value.err.kind == "too_large" and "decompresses" in info.value.err.message


def test_the_ratio_limit_applies_past_the_floor():
    body = gzip.compress(bytes(3 << 20))
    with pytest.raises(BodyRejected) as info:
        _read(body, "gzip", limit=4 << 20, ratio=100)
    assert "ratio" in info.value.err.message
    assert len(_read(gzip.compress(bytes(512 << 10)), "gzip", ratio=100)) == 512 << 10


def test_wire_size_limit_and_bad_streams():
    with pytest.raises(BodyRejected) as info:
        _read(b"x" * 2000, "identity", limit=1024)
    assert info.value.err.http_status == 413
    for encoding, data in (("gzip", b"nope"), ("gzip", gzip.compress(b"abc")[:-6]),
                           ("zstd", b"\x00" * 10)):
        with pytest.raises(BodyRejected) as info:
            _read(data, encoding)
        assert info.value.err.http_status == 400
    with pytest.raises(BodyRejected) as info:
        _read(b"x", "br")
    assert info.value.err.http_status == 415


def test_json_depth_ignores_brackets_inside_strings():
    assert not json_depth_exceeds(b'{"a": "' + b"[" * 500 + b'"}', 8)
    assert not json_depth_exceeds(b'{"a": "\\"[[[[[[[[[[[[[[[[\\""}', 8)
    assert not json_depth_exceeds(b"[" + b"[1]," * 1000 + b"[2]]", 8)
    assert json_depth_exceeds(b"[" * 9 + b"]" * 9, 8)
    assert not json_depth_exceeds(b"[" * 8 + b"]" * 8, 8)


def test_api_keys_roles_and_refusals():
    keys = ApiKeys(["user-key-1234"], ["admin-key-1234"])
    assert keys.role("Bearer user-key-1234") == "user"
    assert keys.role(b"bearer  admin-key-1234 ") == "admin"
    for bad in (None, "", "user-key-1234", "Bearer", "Bearer user-key-12345", "Basic user-key-1234"):
        assert keys.role(bad) is None
    keys.check("Bearer user-key-1234", admin=False, where="t")
    keys.check("Bearer admin-key-1234", admin=False, where="t")
    with pytest.raises(ApiError) as info:
        keys.check("Bearer user-key-1234", admin=True, where="t")
    assert info.value.http_status == 401
    open_api = ApiKeys()
    open_api.check(None, admin=False, where="t")           # no keys: open
    with pytest.raises(ApiError) as info:
        open_api.check("Bearer x", admin=True, where="t")  # ... but admin routes stay shut
    assert info.value.http_status == 403


def test_keys_come_from_flags_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nfile-key-1234\n\n")
    keys = collect_keys(["flag-key-1234", "flag-key-1234"], str(f), "K",
                        {"K": "env-key-1234, env-key-5678"})
    assert keys == ["flag-key-1234", "file-key-1234", "env-key-1234", "env-key-5678"]
    with pytest.raises(ValueError) as info:
        collect_keys(["short"], None, "K", {})
    assert "short" not in str(info.value)
    with pytest.raises(ValueError):
        collect_keys([], str(tmp_path / "missing"), "K", {})


def test_meshllm_serve_passes_security_flags_to_the_gateway(smollm2_dir):
    from services.cli.main import _mesh_config, _serve_parser
    a = _serve_parser("meshllm serve", True).parse_args(
        [str(smollm2_dir), "--api-key", "k-0123456789", "--admin-api-key-file", "/a",
         "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-client-auth", "require"])
    args = _mesh_config(a, str(smollm2_dir), "m").gateway_args
    for flag, value in (("--api-key", "k-0123456789"), ("--admin-api-key-file", "/a"),
                        ("--ssl-certfile", "c.pem"), ("--ssl-keyfile", "k.pem"),
                        ("--ssl-client-auth", "require")):
        assert args[args.index(flag) + 1] == value


# Deserializers that run code or build arbitrary objects. Nothing that crosses a process
# boundary may use them (vLLM / SGLang shipped RCEs through pickle over ZMQ).
_UNSAFE = re.compile(r"""(?x)
    ^\s*(?:import|from)\s+(?:pickle|cPickle|_pickle|marshal|shelve|dill|cloudpickle|joblib)\b
  | \b(?:pickle|marshal|dill|cloudpickle)\.loads?\(
  | (?<![\w.])eval\(
  | (?<![\w.])exec\(
  | \bnp\.load\([^)]*allow_pickle\s*=\s*True
  | \brecv_pyobj\( | \bsend_pyobj\(
  | \byaml\.load\((?![^)]*SafeLoader)
  | \btorch\.load\((?![^)]*weights_only\s*=\s*True)
""")


def test_no_unsafe_deserialization_or_eval_in_the_tree():
    hits = []
    for top in ("services", "scripts", "bench"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d not in ("gen", "__pycache__")]
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    for no, line in enumerate(f, 1):
                        code = line.split("#", 1)[0]
                        if _UNSAFE.search(code):
                            hits.append(f"{os.path.relpath(path, ROOT)}:{no}: {line.strip()}")
    assert not hits, "unsafe deserialization / eval:\n" + "\n".join(hits)


def test_the_scan_would_catch_the_known_patterns():
    for bad in ("import pickle", "from marshal import loads", "x = pickle.loads(b)",
                "sock.recv_pyobj()", "eval(s)", "exec(code)", "torch.load(p)",
                "yaml.load(s)"):
        assert _UNSAFE.search(bad), bad
    for ok in ("torch.load(p, weights_only=True)", "yaml.safe_load(s)", "model.eval()",
               "yaml.load(s, Loader=yaml.SafeLoader)", "self.exec_step()"):
        assert not _UNSAFE.search(ok), ok


def test_admin_keys_alone_leave_the_api_open_and_work_as_api_keys():
    admin_only = ApiKeys([], ["admin-key-1234"])
    assert not admin_only.enabled
    admin_only.check(None, admin=False, where="t")                  # the API stays open
    admin_only.check("Bearer admin-key-1234", admin=True, where="t")
    with pytest.raises(ApiError) as info:
        admin_only.check(None, admin=True, where="t")               # admin routes still need it
    assert info.value.http_status == 401
    both = ApiKeys(["user-key-1234"], ["admin-key-1234"])
    assert both.enabled
    both.check("Bearer admin-key-1234", admin=False, where="t")     # admin key as an API key
    with pytest.raises(ApiError):
        both.check(None, admin=False, where="t")
