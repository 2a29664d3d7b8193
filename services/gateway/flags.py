"""The gateway's security and intake flags (API keys, TLS, intake and connection limits): parsed by the
gateway's main, and passed on by launchers (`meshllm serve/up`) that start a gateway.

This is one of the modules other packages may import (with main and config): the launcher
in services/cli parses the same flags and hands them to the gateway as argv."""
from __future__ import annotations

import argparse

from services.common.tls import CLIENT_AUTH, TlsConfig
from services.gateway.guard.auth import collect_keys

_SECURITY_DESTS = ("api_key", "api_key_file", "admin_api_key", "admin_api_key_file",
                   "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_client_auth")


def parser_names() -> tuple[list[str], list[str]]:
    """(--reasoning-parser names, --tool-call-parser names), for launchers' choices."""
    from services.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS
    return sorted(REASONING_PARSERS), sorted(TOOL_PARSERS)


def add_flags(p: argparse.ArgumentParser, defaults) -> None:
    p.add_argument("--max-inflight-tokens", type=int, default=defaults.max_inflight_tokens,
                   help="admission: prompt + max_tokens of all requests in flight (429 past it)")
    p.add_argument("--max-compression-ratio", type=float,
                   default=defaults.max_compression_ratio,
                   help="refuse Content-Encoding bodies that expand more than this")
    p.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="open HTTP connections per gateway process; past it the oldest idle one "
                        "is closed, or the new one if none is idle (0: min(8192, RLIMIT_NOFILE/2))")
    p.add_argument("--keep-alive-timeout-s", type=float, default=defaults.keep_alive_timeout_s,
                   help="close an HTTP connection idle this long (after connect or a response)")
    p.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                   help="a request head must be complete this long after its first byte")
    p.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s,
                   help="a request body must bring --body-min-rate bytes/s in every window of "
                        "this many seconds (or end), else the connection is closed")
    p.add_argument("--body-min-rate", type=int, default=defaults.body_min_rate,
                   help="bytes per second (see --body-timeout-s)")
    p.add_argument("--max-header-bytes", type=int, default=defaults.max_header_bytes,
                   help="request line + headers, 431 past it")
    p.add_argument("--max-headers", type=int, default=defaults.max_headers,
                   help="headers in one request, 431 past it")
    p.add_argument("--responses-store-max-entries", type=int,
                   default=defaults.responses_store_max_entries,
                   help="stored /v1/responses responses kept (LRU past it; 0: none stored)")
    p.add_argument("--responses-store-max-bytes", type=int,
                   default=defaults.responses_store_max_bytes,
                   help="bytes of stored responses and their conversations (LRU past it)")
    p.add_argument("--responses-store-ttl-s", type=float, default=defaults.responses_store_ttl_s,
                   help="a stored response is gone this long after it was stored")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   default=defaults.enable_tokenizer_info_endpoint,
                   help="serve GET /tokenizer_info (the tokenizer configuration and chat template; "
                        "off by default, as vLLM: it shows a custom --chat-template to every API key holder)")
    p.add_argument("--api-key", action="append", default=[],
                   help="a key clients send as 'Authorization: Bearer KEY' (repeatable; also "
                        "MESHLLM_API_KEYS, comma separated)")
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one per line")
    p.add_argument("--admin-api-key", action="append", default=[],
                   help="a key for admin routes (repeatable; also MESHLLM_ADMIN_API_KEYS)")
    p.add_argument("--admin-api-key-file", default=None, help="a file of admin keys")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM) for HTTP and gRPC")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA bundle that signs client certificates")
    p.add_argument("--ssl-client-auth", choices=CLIENT_AUTH, default="none",
                   help="client certificates: none | optional | require (mTLS)")


def config_kwargs(args: argparse.Namespace) -> dict:
    """The parsed flags as GatewayConfig keyword arguments (keys collected, TLS grouped)."""
    kw = {k: v for k, v in vars(args).items() if k not in _SECURITY_DESTS}
    kw["api_keys"] = collect_keys(args.api_key, args.api_key_file, "MESHLLM_API_KEYS")
    kw["admin_api_keys"] = collect_keys(args.admin_api_key, args.admin_api_key_file,
                                        "MESHLLM_ADMIN_API_KEYS")
    kw["tls"] = TlsConfig(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs,
                          args.ssl_client_auth)
    return kw


def gateway_argv(args: argparse.Namespace) -> list[str]:
    """The security flags of `meshllm serve/up` (parsed by add_flags) as gateway flags."""
    argv: list[str] = []
    for flag in ("--max-inflight-tokens", "--max-compression-ratio", "--max-connections",
                 "--keep-alive-timeout-s", "--header-timeout-s", "--body-timeout-s",
                 "--body-min-rate", "--max-header-bytes", "--max-headers",
                 "--responses-store-max-entries", "--responses-store-max-bytes",
                 "--responses-store-ttl-s", "--api-key-file",
                 "--admin-api-key-file", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs",
                 "--ssl-client-auth"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "enable_tokenizer_info_endpoint", False):
        argv.append("--enable-tokenizer-info-endpoint")
    for key in args.api_key or []:
        argv += ["--api-key", key]
    for key in args.admin_api_key or []:
        argv += ["--admin-api-key", key]
    return argv
