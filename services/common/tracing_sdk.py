"""The OpenTelemetry SDK side of services.common.telemetry, imported only when tracing is on.

Everything that touches the SDK or the OTLP exporter lives here, so a service that runs
without an endpoint never loads them (tests/unit/test_tracing.py pins that).
"""
from __future__ import annotations

import logging

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("meshllm.tracing")

_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT,
          "consumer": SpanKind.CONSUMER, "producer": SpanKind.PRODUCER}
_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer = None
_root_sampler: "RuntimeRatioSampler | None" = None


class RuntimeRatioSampler(Sampler):
    """TraceIdRatioBased whose ratio can be swapped while spans are being started.

    Swapping the delegate is one attribute store, atomic under the GIL, so samplers on other
    threads see either the old or the new ratio, never a torn one."""

    def __init__(self, ratio: float) -> None:
        self._delegate = TraceIdRatioBased(ratio)

    def set_ratio(self, ratio: float) -> None:
        self._delegate = TraceIdRatioBased(ratio)

    @property
    def ratio(self) -> float:
        return self._delegate.rate

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        return self._delegate.should_sample(parent_context, trace_id, name, kind, attributes, links,
                                            trace_state)

    def get_description(self) -> str:
        return f"RuntimeRatioSampler{{{self._delegate.rate}}}"


def start(config) -> None:
    """Install the provider, a batch processor and the OTLP/gRPC exporter for `config`."""
    global _provider, _tracer, _root_sampler
    attrs = {"service.name": f"meshllm-{config.service_name}", "service.namespace": "meshllm"}
    if config.instance_id:
        attrs["service.instance.id"] = config.instance_id
    _root_sampler = RuntimeRatioSampler(config.sampling_ratio)
    # Parent-based: only a root span (the gateway's request span) consults the ratio; every
    # span below follows its parent's sampled flag, so a trace is kept whole or not at all.
    # shutdown_on_exit=False: telemetry.init_service registers a bounded flush at exit instead.
    provider = TracerProvider(sampler=ParentBased(root=_root_sampler), resource=Resource.create(attrs),
                              shutdown_on_exit=False,
                              span_limits=SpanLimits(max_attributes=64, max_events=64, max_links=16))
    endpoint = config.endpoint
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=config.insecure,
                                headers=dict(config.headers) or None,
                                timeout=config.export_timeout_ms / 1000)
    provider.add_span_processor(BatchSpanProcessor(
        exporter, max_queue_size=config.max_queue_size, schedule_delay_millis=config.schedule_delay_ms,
        max_export_batch_size=config.max_export_batch_size, export_timeout_millis=config.export_timeout_ms))
    _provider = provider
    _tracer = provider.get_tracer("meshllm")
    log.info("tracing on: OTLP/gRPC to %s, sampling ratio %.3g", endpoint, config.sampling_ratio)


def shutdown(timeout_s: float) -> None:
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


def force_flush(timeout_s: float) -> bool:
    return _provider.force_flush(int(timeout_s * 1000)) if _provider is not None else True


def set_ratio(ratio: float) -> None:
    if _root_sampler is not None:
        _root_sampler.set_ratio(ratio)


# --- spans -------------------------------------------------------------------------------

def _extract(traceparent: str, tracestate: str = ""):
    """(OTel Context with the remote parent, state): state is "sampled", "unsampled" or
    "invalid" (missing or malformed header)."""
    if not traceparent:
        return None, "invalid"
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _propagator.extract(carrier)
    sc = trace.get_current_span(ctx).get_span_context()
    if not sc.is_valid:
        return None, "invalid"
    return ctx, "sampled" if sc.trace_flags.sampled else "unsampled"


def parent_context(traceparent: str, tracestate: str = ""):
    """An OTel Context whose current span is the remote parent, or None when it is missing,
    malformed or not sampled (downstream services never start traces of their own)."""
    ctx, state = _extract(traceparent, tracestate)
    return ctx if state == "sampled" else None


def start_span(name: str, parent, attributes, start_ns, kind: str, root_ok: bool):
    """`parent`: a Span, a (traceparent, tracestate) pair, or None (the current span)."""
    tracer = _tracer
    if tracer is None:
        return None
    if parent is None:
        ctx = None  # the current context
        if not root_ok and not trace.get_current_span().get_span_context().trace_flags.sampled:
            return None
    elif isinstance(parent, tuple):
        ctx, state = _extract(*parent)
        if state == "unsampled" or (state == "invalid" and not root_ok):
            return None  # the caller decided not to sample, or a downstream hop lost its parent
        if state == "invalid":
            ctx = otel_context.Context()  # a new root, subject to the ratio
    else:
        if not parent.is_recording():
            return None
        ctx = trace.set_span_in_context(parent)
    span = tracer.start_span(name, context=ctx, kind=_KINDS.get(kind, SpanKind.INTERNAL),
                             attributes=attributes, start_time=start_ns)
    if not span.is_recording():
        span.end()
        return None
    return span


def end_span(span, end_ns, error, attributes) -> None:
    if attributes:
        span.set_attributes(attributes)
    if error:
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    span.end(end_time=end_ns)


def add_event(span, name, attributes, ts_ns) -> None:
    span.add_event(name, attributes=attributes, timestamp=ts_ns)


def traceparent_of(span) -> tuple[str, str]:
    sc = span.get_span_context()
    if not sc.is_valid or not sc.trace_flags.sampled:
        return "", ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(NonRecordingSpan(sc)))
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def current_span():
    span = trace.get_current_span()
    return span if span.get_span_context().trace_flags.sampled and span.is_recording() else None


def current_trace_id() -> str | None:
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid or not sc.trace_flags.sampled:
        return None
    return format(sc.trace_id, "032x")


def trace_id_of(span) -> str | None:
    sc = span.get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid else None


def attach(span):
    return otel_context.attach(trace.set_span_in_context(span))


def detach(token) -> None:
    otel_context.detach(token)
