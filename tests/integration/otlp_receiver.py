"""An in-process OTLP/gRPC trace receiver for tests: a real grpc server implementing
opentelemetry.proto.collector.trace.v1.TraceService/Export that keeps every span it gets.

    with OtlpReceiver() as rx:
        start_mesh(model_dir, "--otlp-traces-endpoint", rx.endpoint)
        ...
        spans = rx.wait_for(lambda spans: any(s.name == "worker.request" for s in spans))
"""
from __future__ import annotations

import contextlib
import os

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    """An OTLP AnyValue as a Python value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str                # resource service.name
    name: str
    trace_id: str               # 32 hex digits
    span_id: str                # 16 hex digits
    parent_span_id: str         # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: tuple = ()          # (name, attributes) pairs
    status_code: int = 0        # 0 unset, 1 ok, 2 error


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: "OtlpReceiver") -> None:
        self.sink = sink

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        events=tuple((e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                     for e in s.events),
                        status_code=s.status.code))
        self.sink._add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Listens on 127.0.0.1:<free port>; `endpoint` is what --otlp-traces-endpoint takes."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._lock = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-rx"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"
        self._server.start()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1
            self._lock.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Block until predicate(spans) is true; returns the spans (raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not predicate(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self._spans})
                    raise TimeoutError(f"OTLP receiver: condition not met in {timeout_s}s; "
                                       f"have {len(self._spans)} spans: {names}")
                self._lock.wait(left)
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.stop(grace=0.5).wait()

    def __enter__(self) -> "OtlpReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def prompt_export():
    """Services started inside export each span within 0.1 s of its end (OTEL_BSP_SCHEDULE_DELAY),
    so a test waits for its spans briefly; the variable is restored after."""
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
