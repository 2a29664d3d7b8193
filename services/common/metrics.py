"""Prometheus metrics shared by every service: the `/metrics` listener, exposition with
content negotiation, trace-id exemplars and a gRPC interceptor counting calls by status.

Every metric name starts with `meshllm:` (colons are legal in Prometheus names and mark
these as ours). Engine metrics carry `model_name` and `engine` labels so several engines
(data-parallel replicas) add up in one Prometheus; docs/metrics.md lists them all.

Exemplars (a trace id attached to one histogram sample) only appear in the OpenMetrics
exposition, which a scraper asks for with `Accept: application/openmetrics-text`; both the
gRPC-only services' listener (`start_metrics_server`) and the gateway's `GET /metrics`
(`exposition`) negotiate it.

Several processes behind one port (the gateway's `--api-server-count N`): a scrape lands on
any one of them, so each process writes its values into files of prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set in the processes' environment before they
start) and a scrape exposes the sum over every file (`multiprocess_registry`). Values that
are read from live objects at scrape time are copied there by `CollectorMirror`.
"""
from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from prometheus_client import (REGISTRY, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest, multiprocess)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics import exposition as openmetrics

PREFIX = "meshllm:"

# `_created` series double the exposition for little use (Prometheus ignores them by default).
disable_created_metrics()

# Seconds. Request latencies span a few ms (a short cached prompt on a GPU) to minutes (long
# generations on a CPU); step and RPC latencies are finer.
REQUEST_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                           20.0, 40.0, 80.0, 160.0, 320.0)
STEP_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32,
                        0.64, 1.28, 2.56, 5.12)
RPC_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

_ENGINE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

# Health checks, reflection and Status are polled constantly and say nothing about traffic.
_UNCOUNTED_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/meshllm.v1.Status/")

GRPC_REQUESTS = Counter(
    PREFIX + "grpc_server_requests_total", "gRPC calls handled, by service, method and status code",
    ["service", "method", "code"])
GRPC_LATENCY = Histogram(
    PREFIX + "grpc_server_handling_seconds",
    "time from a gRPC call's arrival to its last response (streams: the whole stream)",
    ["service", "method"], buckets=RPC_LATENCY_BUCKETS)


def add_metrics_args(parser, engine_id: bool = False) -> None:
    """`--metrics-port` (and `--engine-id` for engine services) on a service's parser."""
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port of --host (0 = off)")
    if engine_id:
        parser.add_argument("--engine-id", default="0",
                            help="this engine's (DP replica's) id: the `engine` label of its metrics")


def check_metrics_config(metrics_port: int, engine_id: str | None = None) -> None:
    """Raise ValueError for a bad --metrics-port / --engine-id (config __post_init__)."""
    if not 0 <= metrics_port < 65536:
        raise ValueError(f"--metrics-port must be in [0, 65535], got {metrics_port}")
    if engine_id is not None and not _ENGINE_ID.match(engine_id):
        raise ValueError(f"--engine-id must be 1-64 characters of [A-Za-z0-9._-], got {engine_id!r}")


def start_metrics_server(host: str, port: int, registry=REGISTRY) -> int | None:
    """Serve `registry` at http://host:port/metrics from a daemon thread; port 0 = off.

    Returns the bound port, or None when off. A port already taken ends the process with a
    clear message (like the services' other listeners). Scrapes run on their own threads,
    never on the service's event loop."""
    if not port:
        return None
    if not 0 < port < 65536:
        raise SystemExit(f"--metrics-port must be in [0, 65535], got {port}")

    class Handler(_MetricsHandler):
        pass
    Handler.registry = registry

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    try:
        server = Server((host, port), Handler)
    except OSError as err:
        raise SystemExit(f"cannot bind the metrics address {host}:{port}: {err}") from None
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_address[1]


class _MetricsHandler(BaseHTTPRequestHandler):
    registry = REGISTRY

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        body, content_type = exposition(self.headers.get("Accept"), self.registry)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # scrapes every few seconds: not worth a line
        pass


def exposition(accept: str | None, registry=REGISTRY) -> tuple[bytes, str]:
    """(body, content type) for a scrape: OpenMetrics 1.0 (with exemplars) when the scraper
    accepts it, else the Prometheus text format 0.0.4.

    Not prometheus_client's choose_encoder: its OpenMetrics path (0.26) rewrites the colons
    of sample names to underscores under the default escaping while keeping them in # TYPE
    lines. Our names are valid legacy names, so "allow-utf-8" writes them unchanged."""
    for part in (accept or "").split(","):
        if part.split(";", 1)[0].strip() == "application/openmetrics-text":
            return (openmetrics.generate_latest(registry, escaping=openmetrics.ALLOWUTF8),
                    openmetrics.CONTENT_TYPE_LATEST)
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


def current_trace_exemplar() -> dict[str, str] | None:
    """{"trace_id": ...} for the active sampled span, or None (tracing off or no span)."""
    try:
        from services.common import telemetry
    except ImportError:  # the tracing module is optional for metrics
        return None
    trace_id = telemetry.current_trace_id()
    return {"trace_id": trace_id} if trace_id else None


def traceparent_exemplar(traceparent: str) -> dict[str, str] | None:
    """{"trace_id": ...} from a W3C traceparent ("00-<32 hex>-<16 hex>-<2 hex flags>") of a
    sampled trace, else None: an exemplar should point at a trace that was recorded."""
    parts = traceparent.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[3]) != 2:
        return None
    try:
        sampled = int(parts[3], 16) & 1
        int(parts[1], 16)
    except ValueError:
        return None
    if not sampled or parts[1] == "0" * 32:
        return None
    return {"trace_id": parts[1]}


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call (by method and final status code) and times it.

    Installed outermost by make_server, so calls refused by other interceptors (API keys)
    are counted with their status too. One counter increment and one histogram observation
    per call, never per streamed message."""

    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_UNCOUNTED_GRPC_PREFIXES):
            return handler
        short = method.rsplit("/", 1)[-1]
        record = self._recorder(short)
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, record), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, record), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, record), **kw)
        return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, record), **kw)

    def _recorder(self, method: str):
        service = self.service
        latency = GRPC_LATENCY.labels(service, method)

        def record(context, start: float, failed: BaseException | None) -> None:
            code = context.code()
            if code is None:
                # Not set by the handler: OK if it returned, CANCELLED if the client went away,
                # UNKNOWN for an exception grpc turns into an error.
                code = (grpc.StatusCode.OK if failed is None
                        else grpc.StatusCode.CANCELLED if isinstance(failed, asyncio.CancelledError)
                        else grpc.StatusCode.UNKNOWN)
            name = code.name if isinstance(code, grpc.StatusCode) else str(code)
            GRPC_REQUESTS.labels(service, method, name).inc()
            latency.observe(time.perf_counter() - start)
        return record


def _wrap_unary(behavior, record):
    async def wrapped(request_or_iterator, context):
        start, failed = time.perf_counter(), None
        try:
            return await behavior(request_or_iterator, context)
        except BaseException as exc:
            failed = exc
            raise
        finally:
            record(context, start, failed)
            failed = None  # break the exception -> traceback -> frame cycle
    return wrapped


def _wrap_stream(behavior, record):
    async def wrapped(request_or_iterator, context):
        start, failed, result = time.perf_counter(), None, None
        try:
            result = behavior(request_or_iterator, context)
            if hasattr(result, "__aiter__"):
                async for response in result:
                    yield response
            else:  # a handler that writes with context.write() and returns a coroutine
                await result
        except BaseException as exc:
            failed = exc
            raise
        finally:
            record(context, start, failed)
            failed = None  # no exception -> traceback -> this frame cycle left for the GC
            # A cancelled RPC abandons this generator at its yield: close the handler's own
            # generator now, so its cleanup (aborting the engine request) runs at once
            # rather than whenever the garbage collector gets to it.
            if hasattr(result, "aclose"):
                await result.aclose()
    return wrapped


# ---- several processes behind one port ----------------------------------------------------
# A scrape-time gauge's snapshot, per process: exact (a series that vanished is gone) and
# dropped with its process; the multiprocess .db files can do neither.
_GAUGE_SNAPSHOT = "scrape_gauges_{pid}.json"
GAUGE_MERGES = {"sum": sum, "max": max}


def multiprocess_registry(path: str) -> CollectorRegistry:
    """What a scrape of any one of several sibling processes exposes: every metric of every
    sibling, added up from the files prometheus_client's multiprocess mode keeps in `path`
    (counters and histograms summed, gauges by their `multiprocess_mode`), including those of
    siblings that exited, so totals never go down when one restarts; plus the gauges that
    `CollectorMirror`s snapshot there. The process-local collectors (process_*, python_*) are
    left out: they would describe one random sibling. Exemplars are not kept in multiprocess
    mode (prometheus_client stores none)."""
    if not os.path.isdir(path):
        raise ValueError(f"PROMETHEUS_MULTIPROC_DIR {path!r} is not a directory")
    registry = CollectorRegistry(auto_describe=True)
    multiprocess.MultiProcessCollector(registry, path=path)
    registry.register(_SnapshotGauges(path))
    return registry


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"   # a zombie no longer counts
    except FileNotFoundError:
        return True
    except OSError:   # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _pid_of(name: str) -> int | None:
    stem = os.path.basename(name).rsplit(".", 1)[0]
    pid = stem.rsplit("_", 1)[-1]
    return int(pid) if pid.isdigit() else None


def forget_exited_processes(path: str) -> list[int]:
    """Drop the gauges of siblings that exited (prometheus_client's "live*" gauge files and
    the mirrors' snapshots), so that a crashed sibling's in-flight requests stop counting;
    their counters stay. Returns the pids forgotten."""
    gone = set()
    for name in [*glob.glob(os.path.join(path, "gauge_live*_*.db")),
                 *glob.glob(os.path.join(path, _GAUGE_SNAPSHOT.format(pid="*")))]:
        pid = _pid_of(name)
        if pid is not None and pid != os.getpid() and _exited(pid):
            gone.add(pid)
    for pid in gone:
        multiprocess.mark_process_dead(pid, path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, _GAUGE_SNAPSHOT.format(pid=pid)))
    return sorted(gone)


class CollectorMirror:
    """Copies the families of scrape-time collectors (custom collectors whose `collect()`
    reads live objects, which multiprocess mode never sees) into files of `path`, where a
    scrape of any sibling (`multiprocess_registry`) reads them; `sync()` copies the values of
    now.

    Counter families are cumulative totals and are copied as increments into this process's
    multiprocess counter file, so the siblings' totals add up and outlive them. Gauge families
    are snapshot whole into this process's own file, which goes when it exits; each needs its
    merge across live siblings in `gauge_merges` (by family name): "sum" (e.g. requests in
    flight) or "max" (e.g. a 0/1 flag)."""

    def __init__(self, path: str, gauge_merges: dict[str, str]) -> None:
        bad = {name: how for name, how in gauge_merges.items() if how not in GAUGE_MERGES}
        if bad:
            raise ValueError(f"gauge merges must be one of {sorted(GAUGE_MERGES)}, got {bad}")
        self.path = path
        self.gauge_merges = dict(gauge_merges)
        self._collectors = []
        self._counters: dict[str, Counter] = {}
        self._totals: dict[tuple[str, tuple[str, ...]], float] = {}   # counter series -> total copied

    def add(self, collector) -> None:
        self._collectors.append(collector)

    def sync(self) -> None:
        gauges = []
        for collector in self._collectors:
            for family in collector.collect():
                if family.type == "counter":
                    self._copy_counter(family)
                elif family.type == "gauge":
                    gauges.append(self._snapshot(family))
                else:
                    raise TypeError(f"{family.name!r}: only counter and gauge families can be mirrored, "
                                    f"not {family.type}")
        name = os.path.join(self.path, _GAUGE_SNAPSHOT.format(pid=os.getpid()))
        with open(name + ".tmp", "w", encoding="utf-8") as f:
            json.dump(gauges, f)
        os.replace(name + ".tmp", name)   # a reader sees the old snapshot or the new one, whole

    def close(self) -> None:
        """This process's gauges stop counting (its counters stay)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, _GAUGE_SNAPSHOT.format(pid=os.getpid())))

    def _copy_counter(self, family) -> None:
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue   # _created
            values = tuple(sample.labels.values())
            counter = self._counters.get(family.name)
            if counter is None:
                counter = self._counters[family.name] = Counter(
                    family.name, family.documentation, tuple(sample.labels), registry=None)
            key = (family.name, values)
            delta = sample.value - self._totals.get(key, 0.0)
            if delta > 0:
                (counter.labels(*values) if values else counter).inc(delta)
            self._totals[key] = sample.value

    def _snapshot(self, family) -> dict:
        merge = self.gauge_merges.get(family.name)
        if merge is None:
            raise ValueError(f"gauge {family.name!r} has no merge rule (sum or max)")
        labels = list(family.samples[0].labels) if family.samples else []
        return {"name": family.name, "doc": family.documentation, "merge": merge, "labels": labels,
                "samples": [[list(s.labels.values()), s.value] for s in family.samples]}


class _SnapshotGauges:
    """The CollectorMirror gauge snapshots of every live sibling, merged."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self):
        families: dict[str, dict] = {}
        values: dict[str, dict[tuple[str, ...], list[float]]] = {}
        for name in sorted(glob.glob(os.path.join(self.path, _GAUGE_SNAPSHOT.format(pid="*")))):
            pid = _pid_of(name)
            if pid is None or (pid != os.getpid() and _exited(pid)):
                continue
            try:
                with open(name, encoding="utf-8") as f:
                    snapshot = json.load(f)
            except (FileNotFoundError, ValueError):   # gone since the glob / an older format
                continue
            for fam in snapshot:
                if fam["name"] not in families or not families[fam["name"]]["labels"]:
                    families[fam["name"]] = fam   # one that had samples names the labels
                series = values.setdefault(fam["name"], {})
                for labels, value in fam["samples"]:
                    series.setdefault(tuple(labels), []).append(value)
        for name, fam in families.items():
            out = GaugeMetricFamily(name, fam["doc"], labels=fam["labels"])
            merge = GAUGE_MERGES[fam["merge"]]
            for labels, vals in sorted(values[name].items()):
                out.add_metric(list(labels), merge(vals))
            yield out
