"""The gateway's Prometheus metrics: HTTP requests by route and status, their latency (with
trace-id exemplars), requests in flight, and the `GET /metrics` route itself.

`/metrics` is served on the HTTP port without API keys (auth.OPEN_HTTP_PATHS), like
/health: Prometheus scrapes it from inside the deployment and it holds no request data.
Its gRPC calls are counted by the interceptor every service has (services/common/metrics.py).
With several gateway processes on one port (services/gateway/shared_metrics.py) a scrape
answers for all of them."""
from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from starlette.requests import Request
from starlette.responses import Response

from services.common.metrics import PREFIX, REQUEST_LATENCY_BUCKETS, exposition

HTTP_REQUESTS = Counter(PREFIX + "http_requests_total", "HTTP requests answered, by route and status",
                        ["method", "route", "status"])
HTTP_LATENCY = Histogram(PREFIX + "http_request_duration_seconds",
                         "HTTP request received -> response complete (streams: the last event)",
                         ["method", "route"], buckets=REQUEST_LATENCY_BUCKETS)
# livesum: with several gateway processes, the in-flight requests of the live ones add up.
INFLIGHT = Gauge(PREFIX + "gateway_requests_inflight", "engine requests the gateway has in flight",
                 ["model_name"], multiprocess_mode="livesum")
_TRACKED: dict[str, tuple[Gauge, object]] = {}   # model name -> (INFLIGHT child, its count callable)

UNMATCHED_ROUTE = "unmatched"   # any path no route serves (bounded label values)


class RouteNames:
    """Maps a request path to its route template (`/v1/models/{model}`), so that label values
    are bounded whatever paths clients send."""

    def __init__(self, routes) -> None:
        self._routes = routes   # the app's live route list: read at the first request, so
        self.exact: dict[str, str] | None = None   # routes added after wiring count too
        self.templated = []

    def _build(self) -> dict[str, str]:
        exact = {}
        for r in self._routes:
            path = getattr(r, "path", None)
            if path is None:
                continue
            if "{" in path:
                self.templated.append((r.path_regex, path))
            else:
                exact[path] = path
        self.exact = exact
        return exact

    def __call__(self, path: str) -> str:
        name = (self.exact if self.exact is not None else self._build()).get(path)
        if name is not None:
            return name
        for regex, template in self.templated:
            if regex.match(path):
                return template
        return UNMATCHED_ROUTE


def record_http(method: str, route: str, status: int, seconds: float, exemplar: dict | None) -> None:
    HTTP_REQUESTS.labels(method, route, str(status)).inc()
    HTTP_LATENCY.labels(method, route).observe(seconds, exemplar)


def track_inflight(model_name: str, count) -> None:
    """Read the engine client's in-flight count at scrape time (`count` is a callable)."""
    child = INFLIGHT.labels(model_name)
    child.set_function(count)
    _TRACKED[model_name] = (child, count)


def write_tracked_gauges() -> None:
    """Multiprocess mode: store the scrape-time gauges' values of now in this process's
    files (a sibling's scrape reads only those; set_function values never reach them)."""
    for child, count in _TRACKED.values():
        child.set(count())


async def metrics_route(request: Request) -> Response:
    # app.state.shared_metrics: set when several gateway processes share the port.
    shared = getattr(request.app.state, "shared_metrics", None)
    registry = shared.scrape_registry() if shared is not None else REGISTRY
    body, content_type = exposition(request.headers.get("accept"), registry)
    return Response(body, media_type=content_type)
