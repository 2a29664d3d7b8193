"""`python -m services.profiler --artifact-dir DIR --worker NAME=HOST:PORT ... [--service NAME=HOST:PORT ...]`.

Serves meshllm.v1.ProfilerControl and grpc.health.v1. MESHLLM_CONTROL_API_KEY (or
--control-api-key-file) is the admin key it presents to the gateway's public port."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from services.common import internal_tls, telemetry
from services.common.log import setup_logging
from services.common.metrics import add_metrics_args
from services.common.profiling import default_profile_dir
from services.profiler.config import ProfilerConfig, parse_target


def parse_args(argv: list[str] | None) -> ProfilerConfig:
    d = ProfilerConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m services.profiler", description=__doc__)
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="gRPC port (0: any free port)")
    p.add_argument("--artifact-dir", default=default_profile_dir(),
                   help="capture traces go to DIR/<capture id>/ (workers must be able to write there; "
                        "default $MESHLLM_CACHE/profiles or ~/.cache/meshllm/profiles)")
    p.add_argument("--worker", action="append", default=[],
                   help="a worker's WorkerControl address, NAME=HOST:PORT or HOST:PORT (repeatable)")
    p.add_argument("--service", action="append", default=[],
                   help="an internal service's TelemetryControl address, NAME=HOST:PORT (repeatable)")
    p.add_argument("--gateway-addr", default="",
                   help="the gateway's public gRPC address (TelemetryControl there needs an admin key)")
    p.add_argument("--control-api-key-file", default=None,
                   help="a file whose first line is the admin key for the gateway "
                        "(default: MESHLLM_CONTROL_API_KEY)")
    for name in ("rpc_timeout_s", "stop_timeout_s", "poll_interval_s", "write_timeout_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=d[name].default)
    p.add_argument("--log-level", default=None)
    add_metrics_args(p)
    internal_tls.add_flags(p)
    a = p.parse_args(argv)
    try:
        # The first key when several are given (a comma-separated admin key list).
        key = os.environ.get("MESHLLM_CONTROL_API_KEY", "").split(",")[0].strip()
        if a.control_api_key_file:
            with open(a.control_api_key_file, encoding="utf-8") as f:
                key = next((line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")), "")
        return ProfilerConfig(
            artifact_dir=os.path.abspath(a.artifact_dir), host=a.host, port=a.port,
            workers=[parse_target(s, f"worker{i}") for i, s in enumerate(a.worker)],
            services=[parse_target(s, s) for s in a.service], gateway_addr=a.gateway_addr,
            control_api_key=key, rpc_timeout_s=a.rpc_timeout_s, stop_timeout_s=a.stop_timeout_s,
            poll_interval_s=a.poll_interval_s, write_timeout_s=a.write_timeout_s,
            internal_tls=internal_tls.from_args(a), metrics_port=a.metrics_port, log_level=a.log_level)
    except (ValueError, OSError) as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(telemetry.init_service("profiler", argv))  # tracing flags + OTEL_*
    setup_logging("profiler", cfg.log_level)
    from services.profiler.server import serve  # grpc import after the flags are valid
    try:
        return asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
