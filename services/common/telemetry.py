"""Tracing for every meshllm service: one call to switch it on, one boolean to test.

Off by default. When off, nothing here imports the OpenTelemetry SDK or exporter
(`services.common.tracing_sdk` is only imported by `init_tracing` with an endpoint),
and every helper returns at once after reading the module-level `ENABLED` flag.

Hot paths do::

    from services.common import telemetry
    if telemetry.ENABLED:
        ...  # build spans

The sampling ratio is process-wide and can change at run time
(`set_trace_sampling_ratio`, driven by the profiler's TelemetryControl RPC); the
sampler is parent-based, so only the root service (the gateway) applies the ratio
and every service downstream follows the caller's sampled flag.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Mapping

# The one boolean hot paths check. Rebound only by init_tracing / shutdown_tracing.
ENABLED: bool = False

_lock = threading.Lock()
_ratio: float = 1.0
_sdk = None  # the services.common.tracing_sdk module once tracing is on


@dataclass(frozen=True)
class TracingConfig:
    """Validated tracing settings of one service (built in each service's main())."""

    service_name: str
    endpoint: str | None = None          # OTLP/gRPC collector address; None = tracing off
    sampling_ratio: float = 1.0          # root sampling ratio, 0..1
    insecure: bool = True                # plaintext gRPC to the collector (typical sidecar)
    headers: tuple[tuple[str, str], ...] = ()  # extra gRPC metadata for the collector
    schedule_delay_ms: int = 500         # batch span processor export interval
    max_queue_size: int = 4096           # spans buffered before new ones are dropped
    max_export_batch_size: int = 512
    export_timeout_ms: int = 10_000
    instance_id: str = ""                # service.instance.id resource attribute (e.g. "rank0")

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("tracing: service_name must not be empty")
        _check_ratio(self.sampling_ratio)
        if self.schedule_delay_ms <= 0 or self.max_queue_size <= 0 or self.max_export_batch_size <= 0:
            raise ValueError("tracing: schedule delay, queue size and batch size must be > 0")
        if self.max_export_batch_size > self.max_queue_size:
            raise ValueError("tracing: max_export_batch_size must be <= max_queue_size")
        if self.export_timeout_ms <= 0:
            raise ValueError("tracing: export timeout must be > 0")


def _check_ratio(ratio: float) -> float:
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"trace sampling ratio must be a number in [0, 1], got {ratio!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"trace sampling ratio must be in [0, 1], got {ratio!r}")
    return value


def init_tracing(service_name: str, endpoint: str | None = None, sampling_ratio: float = 1.0,
                 **options) -> bool:
    """Start tracing for this process; returns whether it is on.

    `endpoint` None or "" leaves tracing off and imports nothing. `options` are the
    other TracingConfig fields. Safe to call once per process; a second call with an
    endpoint raises (one provider per process).
    """
    return init_tracing_from_config(TracingConfig(service_name=service_name, endpoint=endpoint or None,
                                                  sampling_ratio=sampling_ratio, **options))


def init_tracing_from_config(config: TracingConfig) -> bool:
    global ENABLED, _sdk, _ratio
    with _lock:
        _ratio = config.sampling_ratio
        if not config.endpoint:
            return False
        if ENABLED:
            raise RuntimeError("tracing is already initialised in this process")
        from services.common import tracing_sdk  # the only place the SDK gets imported
        tracing_sdk.start(config)
        _sdk = tracing_sdk  # kept after shutdown: its functions are safe (no-ops) then
        ENABLED = True
        return True


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush buffered spans and stop the exporter (call on service shutdown)."""
    global ENABLED
    with _lock:
        sdk = _sdk if ENABLED else None
        ENABLED = False
    if sdk is not None:
        # The exporter may be mid-retry against a dead collector: never hold a stopping
        # service longer than timeout_s (the export thread is a daemon and dies with us).
        worker = threading.Thread(target=sdk.shutdown, args=(timeout_s,), name="tracing-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)


def force_flush(timeout_s: float = 5.0) -> bool:
    return _sdk.force_flush(timeout_s) if ENABLED else True


def set_trace_sampling_ratio(ratio: float) -> float:
    """Change the root sampling ratio at run time; returns the previous ratio.

    Applies to requests that start after the call. Works while tracing is off too (the
    value is kept and used if tracing is switched on later). Raises ValueError outside [0, 1].
    """
    global _ratio
    value = _check_ratio(ratio)
    with _lock:
        previous, _ratio = _ratio, value
        sdk = _sdk
    if sdk is not None:
        sdk.set_ratio(value)
    return previous


def get_trace_sampling_ratio() -> float:
    return _ratio


def current_trace_id() -> str | None:
    """The 32-hex trace id of the current sampled span, or None (tracing off / not sampled)."""
    if not ENABLED:
        return None
    return _sdk.current_trace_id()


def config_from_env(service_name: str, endpoint: str | None = None, sampling_ratio: float | None = None,
                    env: Mapping[str, str] | None = None, **options) -> TracingConfig:
    """Merge a service's flags with the standard OTEL_* variables (flags win).

    Read only from main(). Honoured: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (then
    OTEL_EXPORTER_OTLP_ENDPOINT), OTEL_SDK_DISABLED, OTEL_TRACES_SAMPLER_ARG,
    OTEL_EXPORTER_OTLP_TRACES_INSECURE / OTEL_EXPORTER_OTLP_INSECURE,
    OTEL_EXPORTER_OTLP_TRACES_HEADERS / OTEL_EXPORTER_OTLP_HEADERS, OTEL_BSP_SCHEDULE_DELAY,
    OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_BSP_EXPORT_TIMEOUT.
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingConfig(service_name=service_name, endpoint=None)
    endpoint = (endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)
    if sampling_ratio is None:
        raw = env.get("OTEL_TRACES_SAMPLER_ARG")
        sampling_ratio = _check_ratio(raw) if raw else 1.0
    insecure_raw = env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or env.get("OTEL_EXPORTER_OTLP_INSECURE")
    if insecure_raw and "insecure" not in options:
        options["insecure"] = insecure_raw.strip().lower() == "true"
    if endpoint and endpoint.startswith("https://") and "insecure" not in options:
        options["insecure"] = False
    headers_raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    if headers_raw and "headers" not in options:
        options["headers"] = _parse_headers(headers_raw)
    for var, key in (("OTEL_BSP_SCHEDULE_DELAY", "schedule_delay_ms"), ("OTEL_BSP_MAX_QUEUE_SIZE", "max_queue_size"),
                     ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "max_export_batch_size"),
                     ("OTEL_BSP_EXPORT_TIMEOUT", "export_timeout_ms")):
        if env.get(var) and key not in options:
            try:
                options[key] = int(env[var])
            except ValueError:
                raise ValueError(f"{var} must be an integer, got {env[var]!r}") from None
    return TracingConfig(service_name=service_name, endpoint=endpoint, sampling_ratio=sampling_ratio, **options)


def _parse_headers(raw: str) -> tuple[tuple[str, str], ...]:
    from urllib.parse import unquote
    out = []
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError("OTLP headers must be comma-separated key=value pairs")
        out.append((key.strip().lower(), unquote(value.strip())))
    return tuple(out)


def add_tracing_args(parser) -> None:
    """The tracing flags (init_service parses them; this adds them to a parser's --help)."""
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="OTLP/gRPC collector for traces (host:port or http(s)://host:port); "
                             "default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else tracing is off")
    parser.add_argument("--trace-sampling-ratio", type=float, default=None,
                        help="fraction of new requests traced, 0..1 (default: OTEL_TRACES_SAMPLER_ARG or 1.0)")


def split_tracing_args(service_name: str, argv: list[str] | None,
                       env: Mapping[str, str] | None = None) -> tuple[list[str], TracingConfig]:
    """Take the tracing flags out of `argv`: (the other args, the validated TracingConfig).

    Read only from a service's main(); raises ValueError on a bad value."""
    import argparse
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_tracing_args(p)
    try:
        args, rest = p.parse_known_args(argv)
    except SystemExit:
        raise ValueError("--trace-sampling-ratio must be a number in [0, 1]") from None
    return rest, config_from_env(service_name, args.otlp_traces_endpoint, args.trace_sampling_ratio, env=env)


def init_service(service_name: str, argv: list[str] | None = None, **options) -> list[str]:
    """A service main()'s one call: strip the tracing flags from argv (default sys.argv[1:]),
    merge OTEL_* variables, start tracing if an endpoint is set (flushing at exit), and return
    the remaining args for the service's own parser. Bad values exit with status 2."""
    import sys
    try:
        rest, config = split_tracing_args(service_name, argv)
        if options:
            from dataclasses import replace
            config = replace(config, **options)
    except ValueError as err:
        print(f"{service_name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if init_tracing_from_config(config):
        import atexit
        atexit.register(shutdown_tracing, 3.0)
    return rest


def init_from_args(service_name: str, args, env: Mapping[str, str] | None = None, **options) -> bool:
    """Like init_service, for a parser that already has add_tracing_args' flags."""
    return init_tracing_from_config(config_from_env(
        service_name, getattr(args, "otlp_traces_endpoint", None),
        getattr(args, "trace_sampling_ratio", None), env=env, **options))


# --- spans (every function is a no-op returning None / "" while tracing is off) ----------

def start_span(name: str, *, parent=None, traceparent: str | None = None, tracestate: str = "",
               attributes: dict | None = None, start_ns: int | None = None, kind: str = "internal",
               root: bool = False):
    """Start a span; returns it, or None when tracing is off or the request is not sampled.

    Parent: `parent` (a span returned here), else `traceparent`/`tracestate` (W3C strings
    from gRPC metadata or a TraceContext message), else the current span. Without `root`
    a span is only started under a sampled parent: services below the gateway never begin
    traces of their own. With `root` (the gateway's request span) a missing or malformed
    traceparent starts a new trace, subject to the sampling ratio; an incoming unsampled
    traceparent is honoured (no spans).
    """
    if not ENABLED:
        return None
    if traceparent is not None:
        parent = (traceparent, tracestate)
    return _sdk.start_span(name, parent, attributes, start_ns, kind, root)


def end_span(span, *, end_ns: int | None = None, error: str | None = None,
             attributes: dict | None = None) -> None:
    if span is not None:
        _sdk.end_span(span, end_ns, error, attributes)


def add_event(span, name: str, attributes: dict | None = None, ts_ns: int | None = None) -> None:
    if span is not None:
        _sdk.add_event(span, name, attributes, ts_ns)


def traceparent_of(span) -> tuple[str, str]:
    """(traceparent, tracestate) to send downstream; ("", "") for None or unsampled."""
    if span is None or not ENABLED:
        return "", ""
    return _sdk.traceparent_of(span)


def trace_id_of(span) -> str | None:
    return _sdk.trace_id_of(span) if span is not None and ENABLED else None


def current_span():
    """The current sampled, recording span of this task/thread, or None."""
    return _sdk.current_span() if ENABLED else None


def attach(span):
    """Make `span` current in this context (contextvars); returns a token for detach()."""
    return _sdk.attach(span) if span is not None and ENABLED else None


def detach(token) -> None:
    if token is not None and _sdk is not None:
        _sdk.detach(token)


def grpc_metadata(span=None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying `span` (default: the current span), or None."""
    if not ENABLED:
        return None
    span = span if span is not None else _sdk.current_span()
    if span is None:
        return None
    tp, ts = _sdk.traceparent_of(span)
    if not tp:
        return None
    return (("traceparent", tp), ("tracestate", ts)) if ts else (("traceparent", tp),)


def traceparent_from_metadata(metadata) -> tuple[str, str]:
    """(traceparent, tracestate) from a grpc.aio server context's invocation_metadata()."""
    tp = ts = ""
    for key, value in metadata or ():
        if key == "traceparent":
            tp = value if isinstance(value, str) else ""
        elif key == "tracestate":
            ts = value if isinstance(value, str) else ""
    return tp, ts


def annotate(attributes: dict) -> None:
    """Add attributes (counts, ids: never prompt text) to the current span, if any."""
    if ENABLED:
        span = _sdk.current_span()
        if span is not None:
            span.set_attributes(attributes)


def set_attributes(span, attributes: dict) -> None:
    """Add attributes (counts, ids: never prompt text) to `span` (a no-op for None)."""
    if span is not None:
        span.set_attributes(attributes)
