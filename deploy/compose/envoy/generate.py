"""Write the Envoy sidecar configs of the docker-compose mesh (one per service identity).

    python deploy/compose/envoy/generate.py        # rewrites deploy/compose/envoy/*.yaml

The YAML files are committed; tests/unit/test_deploy_envoy.py fails when they differ from
what this script writes, and parses each one into envoy.config.bootstrap.v3.Bootstrap.

Layout of every sidecar (it shares the network namespace of its service's container):

  127.0.0.1:<port>   egress: plain gRPC (or TCP) from the local service, sent on over mTLS to
                     the peer's sidecar. The port is the peer service's own port, so the
                     service's default --*-addr flags (127.0.0.1:50052, ...) are right as is.
  0.0.0.0:15443      ingress ("mesh port"): mTLS, HTTP/2. gRPC goes to the local service,
                     /metrics to its Prometheus listener, /stats/prometheus to Envoy's own.
                     RBAC admits only the certificate identities in the sidecar's `peers`
                     (Prometheus only for the metrics paths).
  0.0.0.0:15556      worker only: the scheduler <-> worker ZMQ link as TLS-wrapped TCP.
  0.0.0.0:8443       gateway only: the public listener (TLS; HTTP/1.1 + HTTP/2; OpenAI HTTP
                     and gRPC on one port, split by content-type).
  127.0.0.1:4317     egress for OTLP traces, to the otel-collector.
  127.0.0.1:9901     admin (never reachable from outside the container).

`python deploy/compose/envoy/generate.py` also writes deploy/compose/prometheus.yml, which
scrapes the same mesh ports.
"""
from __future__ import annotations

import pathlib
import re
import sys
from dataclasses import dataclass

import yaml

HERE = pathlib.Path(__file__).resolve().parent

MESH_PORT = 15443          # every sidecar's mTLS ingress
ZMQ_MESH_PORT = 15556      # the worker sidecar's TLS ingress for ZMQ
PUBLIC_PORT = 8443         # the gateway sidecar's public listener
ADMIN_PORT = 9901
METRICS_PORT = 9400        # every service's --metrics-port (each has its own network namespace)
OTLP_PORT = 4317           # OTLP/gRPC: local egress and the collector's receiver
CERT_DIR = "/etc/meshllm/certs"            # dev CA: ca.pem, <identity>.pem/.key
PUBLIC_TLS_DIR = "/etc/meshllm/public-tls"  # tls.crt / tls.key of the public listener

# Each service's own listening ports inside its namespace (its flags in docker-compose.yml).
APP_PORTS = {"gateway": 50051, "tokenizer": 50052, "scheduler": 50053, "worker": 50054,
             "embedder": 50055, "supervisor": 50060, "profiler": 50061, "kvstore": 50070}
GATEWAY_HTTP_PORT = 8000
WORKER_ZMQ_PORT = 50056
# Compose hosts (network aliases of the sidecars) behind each identity.
HOSTS = {"tokenizer": ("tokenizer-1", "tokenizer-2")}

# Calls that change nothing and may be retried on another host; nothing else is retried
# (a retried Generate/EngineStream would run a request twice).
IDEMPOTENT_PATHS = (
    "/grpc.health.v1.Health/Check",
    "/meshllm.v1.Status/GetStatus",
    "/meshllm.v1.Tokenizer/GetInfo",
    "/meshllm.v1.Embedder/GetInfo",
    "/meshllm.v1.Engine/GetEngineInfo",
    "/meshllm.v1.Engine/GetLoad",
    "/meshllm.v1.Supervisor/ListReplicas",
    "/meshllm.v1.TelemetryControl/GetTraceSampling",
    "/meshllm.v1.WorkerControl/ProfileStatus",
    "/meshllm.v1.ProfilerControl/Status",
)
# Public streams (SSE, gRPC Generate) get no route timeout; this bounds them instead.
PUBLIC_MAX_STREAM_S = 3600


@dataclass(frozen=True)
class Egress:
    """127.0.0.1:local_port in the service's namespace -> `hosts` (their sidecars' mesh
    port), accepting only a server certificate that names `identity`."""
    local_port: int
    cluster: str
    hosts: tuple[str, ...]
    identity: str
    health_service: str | None  # active grpc.health.v1 checks; None: outlier detection only
    authority: str | None = None  # rewrite :authority so the peer's sidecar picks a local target


def egress_to(peer: str) -> Egress:
    """The usual egress: the peer's own port, all of its hosts, its readiness name."""
    return Egress(APP_PORTS[peer], f"{peer}_mesh", HOSTS.get(peer, (peer,)), peer, peer)


def egress_each(peer: str) -> list[Egress]:
    """One egress per host of `peer` (the profiler must reach every replica, not any one):
    host i listens on the peer's port + 100 * i."""
    return [Egress(APP_PORTS[peer] + 100 * i, f"{host}_mesh", (host,), peer, peer)
            for i, host in enumerate(HOSTS.get(peer, (peer,)))]


# The supervisor runs a second data-parallel engine ("engine-1": scheduler + worker processes)
# inside its container; its scheduler listens here and is reached through the supervisor's sidecar
# under the authority "engine-1" (every call, grpc.health.v1 included, goes to that scheduler).
SUPERVISED_ENGINE_PORT = 50063
SUPERVISED_ENGINE = Egress(SUPERVISED_ENGINE_PORT, "engine1_mesh", ("supervisor",), "supervisor", None,
                           authority="engine-1")
# Its processes' /metrics listeners, published on the supervisor's mesh port under these paths.
SUPERVISED_METRICS = (("/metrics/engine-1/scheduler", 9401), ("/metrics/engine-1/worker", 9402))


@dataclass(frozen=True)
class Sidecar:
    identity: str                                   # certificate name = service name
    peers: tuple[str, ...]                          # identities admitted on the mesh port
    egress: tuple[Egress, ...] = ()                 # what the service calls over gRPC
    local_hosts: tuple[tuple[str, int], ...] = ()   # ingress :authority -> another local port
    extra_metrics: tuple[tuple[str, int], ...] = ()  # ingress path -> another local /metrics
    zmq_to_worker: bool = False                     # scheduler: ZMQ egress to the worker
    zmq_from: tuple[str, ...] = ()                  # worker: identities admitted on ZMQ ingress
    public: bool = False                            # gateway: the published listener

    @property
    def app_port(self) -> int:
        return APP_PORTS[self.identity]

    @property
    def metrics_port(self) -> int:
        # The gateway serves /metrics on its HTTP port; the others on --metrics-port.
        return GATEWAY_HTTP_PORT if self.identity == "gateway" else METRICS_PORT


SIDECARS = (
    Sidecar("gateway", peers=("prometheus", "profiler"), public=True,
            egress=(egress_to("tokenizer"), egress_to("scheduler"), egress_to("embedder"), egress_to("profiler"),
                    SUPERVISED_ENGINE)),
    Sidecar("tokenizer", peers=("gateway", "prometheus", "profiler")),
    Sidecar("scheduler", peers=("gateway", "prometheus", "profiler"), zmq_to_worker=True,
            egress=(egress_to("kvstore"),)),
    Sidecar("worker", peers=("prometheus", "profiler"), zmq_from=("scheduler",), egress=(egress_to("kvstore"),)),
    Sidecar("embedder", peers=("gateway", "prometheus", "profiler")),
    Sidecar("supervisor", peers=("gateway", "prometheus", "profiler"), egress=(egress_to("kvstore"),),
            local_hosts=(("engine-1", SUPERVISED_ENGINE_PORT),), extra_metrics=SUPERVISED_METRICS),
    Sidecar("profiler", peers=("gateway", "prometheus"),
            egress=(*egress_each("gateway"), *egress_each("tokenizer"), *egress_each("scheduler"),
                    *egress_each("worker"), *egress_each("embedder"))),
    # The secondary KV tier (docs/kvstore.md): the engines' processes are its only callers.
    Sidecar("kvstore", peers=("scheduler", "worker", "supervisor", "prometheus")),
)


# ---- building blocks -------------------------------------------------------------------

def _any(type_name: str, **fields) -> dict:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _addr(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _cert(identity: str) -> dict:
    return {"certificate_chain": {"filename": f"{CERT_DIR}/{identity}.pem"},
            "private_key": {"filename": f"{CERT_DIR}/{identity}.key"}}


TLS_PARAMS = {"tls_minimum_protocol_version": "TLSv1_2"}


def _downstream_mtls(identity: str, alpn: list[str] | None) -> dict:
    ctx = {"common_tls_context": {"tls_params": TLS_PARAMS, "tls_certificates": [_cert(identity)],
                                  "validation_context": {"trusted_ca": {"filename": f"{CERT_DIR}/ca.pem"}}},
           "require_client_certificate": True}
    if alpn:
        ctx["common_tls_context"]["alpn_protocols"] = alpn
    return {"name": "envoy.transport_sockets.tls",
            "typed_config": _any("envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext", **ctx)}


def _upstream_mtls(identity: str, peer: str, alpn: list[str] | None) -> dict:
    """Present our certificate; accept only a server whose certificate names `peer`."""
    common = {"tls_params": TLS_PARAMS, "tls_certificates": [_cert(identity)],
              "validation_context": {
                  "trusted_ca": {"filename": f"{CERT_DIR}/ca.pem"},
                  "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": peer}}]}}
    if alpn:
        common["alpn_protocols"] = alpn
    return {"name": "envoy.transport_sockets.tls",
            "typed_config": _any("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                                 common_tls_context=common, sni=peer)}


def _h2_options(keepalive: bool) -> dict:
    h2 = {"max_concurrent_streams": 1024, "initial_stream_window_size": 1048576,
          "initial_connection_window_size": 16777216}
    if keepalive:  # long-lived idle streams (EngineStream, Detokenize): find dead peers
        h2["connection_keepalive"] = {"interval": "30s", "timeout": "10s"}
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        explicit_http_config={"http2_protocol_options": h2})}


def _h1_options() -> dict:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        common_http_protocol_options={"idle_timeout": "300s"},
        explicit_http_config={"http_protocol_options": {}})}


def _breakers(max_requests: int) -> dict:
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": 1024, "max_pending_requests": 1024,
                            "max_requests": max_requests, "max_retries": 3,
                            "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 3}}]}


OUTLIER = {"consecutive_5xx": 5, "consecutive_gateway_failure": 3, "consecutive_local_origin_failure": 3,
           "split_external_local_origin_errors": True, "interval": "5s", "base_ejection_time": "15s",
           "max_ejection_percent": 50}


def _cluster(name: str, hosts: list[tuple[str, int]], *, dns: bool, options: dict | None = None,
             tls: dict | None = None, max_requests: int = 4096, outlier: bool = False,
             health_service: str | None = None) -> dict:
    c = {"name": name, "type": "STRICT_DNS" if dns else "STATIC", "connect_timeout": "2s",
         "lb_policy": "LEAST_REQUEST",
         "load_assignment": {"cluster_name": name, "endpoints": [
             {"lb_endpoints": [{"endpoint": {"address": _addr(h, p)}} for h, p in hosts]}]},
         "circuit_breakers": _breakers(max_requests)}
    if dns:
        c["dns_lookup_family"] = "V4_ONLY"
    if options:
        c["typed_extension_protocol_options"] = options
    if tls:
        c["transport_socket"] = tls
    if outlier:
        c["outlier_detection"] = OUTLIER
    if health_service is not None:  # active grpc.health.v1 readiness checks through the peer's sidecar
        c["health_checks"] = [{"timeout": "2s", "interval": "5s", "unhealthy_threshold": 2,
                               "healthy_threshold": 1, "grpc_health_check": {"service_name": health_service}}]
    return c


def _access_log() -> list[dict]:
    # Method, path without the query string, status, sizes, duration: never bodies or headers.
    fmt = ("[%START_TIME%] %REQ(:METHOD)% %REQ_WITHOUT_QUERY(:PATH)% %PROTOCOL% %RESPONSE_CODE% "
           "%GRPC_STATUS% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION%ms "
           "%UPSTREAM_CLUSTER%\n")
    return [{"name": "envoy.access_loggers.stdout", "typed_config": _any(
        "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
        log_format={"text_format_source": {"inline_string": fmt}})}]


def _router() -> dict:
    return {"name": "envoy.filters.http.router",
            "typed_config": _any("envoy.extensions.filters.http.router.v3.Router")}


def _hcm(stat_prefix: str, routes: list[dict], *, codec: str, idle_s: int, http_filters: list[dict],
         public: bool = False, extra_hosts: list[dict] | None = None) -> dict:
    h2 = {"max_concurrent_streams": 256 if public else 1024,
          "initial_stream_window_size": 1048576, "initial_connection_window_size": 16777216}
    cfg = {"stat_prefix": stat_prefix, "codec_type": codec,
           "route_config": {"name": stat_prefix, "virtual_hosts": [
               *(extra_hosts or []), {"name": stat_prefix, "domains": ["*"], "routes": routes}]},
           "http_filters": [*http_filters, _router()],
           "http2_protocol_options": h2,
           # 0s turns the idle timeout off: internal streams (EngineStream, Detokenize) may sit idle
           # for long; dead peers are found by HTTP/2 keepalive on the clusters instead.
           "stream_idle_timeout": f"{idle_s}s",
           "request_headers_timeout": "10s",
           "common_http_protocol_options": {"idle_timeout": "3600s",
                                            "headers_with_underscores_action": "REJECT_REQUEST"},
           "max_request_headers_kb": 64,
           "normalize_path": True, "merge_slashes": True,
           "access_log": _access_log()}
    if public:
        cfg["use_remote_address"] = True
        cfg["http_protocol_options"] = {"accept_http_10": False}
    return {"name": "envoy.filters.network.http_connection_manager",
            "typed_config": _any("envoy.extensions.filters.network.http_connection_manager.v3"
                                 ".HttpConnectionManager", **cfg)}


def _stream_route(match: dict, cluster: str, *, bound_s: int | None) -> dict:
    """No route timeout (it would cut long SSE / gRPC streams); `bound_s` caps a whole
    stream instead, and a client's grpc-timeout header is honoured up to that cap."""
    route = {"cluster": cluster, "timeout": "0s"}
    if bound_s:
        route["max_stream_duration"] = {"max_stream_duration": f"{bound_s}s",
                                        "grpc_timeout_header_max": f"{bound_s}s"}
    else:  # internal long-lived streams: only the caller's own grpc-timeout applies
        route["idle_timeout"] = "0s"
        route["max_stream_duration"] = {"grpc_timeout_header_max": "0s"}
    return {"match": match, "route": route}


def _retry_routes(cluster: str) -> list[dict]:
    """One route for every idempotent control call: the only traffic that is retried."""
    regex = "^(" + "|".join(re.escape(p) for p in IDEMPOTENT_PATHS) + ")$"
    return [{"match": {"safe_regex": {"regex": regex}}, "route": {
        "cluster": cluster, "timeout": "15s",
        "retry_policy": {"retry_on": "connect-failure,refused-stream,unavailable,reset",
                         "num_retries": 2, "per_try_timeout": "5s",
                         "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                                   "typed_config": _any(
                                                       "envoy.extensions.retry.host.previous_hosts.v3"
                                                       ".PreviousHostsPredicate")}],
                         "host_selection_retry_max_attempts": 3}}}]


def _rbac_http(peers: tuple[str, ...], extra_metrics: tuple[tuple[str, int], ...] = ()) -> dict:
    """Admit only certificates naming a peer identity; Prometheus only for the metrics paths."""
    paths = ["/metrics", "/stats/prometheus", *(p for p, _ in extra_metrics)]
    scrape = {"or_rules": {"rules": [{"url_path": {"path": {"exact": p}}} for p in paths]}}
    policies = {}
    callers = [p for p in peers if p != "prometheus"]
    if callers:
        policies["mesh-peers"] = {"permissions": [{"any": True}], "principals": [
            {"authenticated": {"principal_name": {"exact": p}}} for p in callers]}
    if "prometheus" in peers:
        policies["prometheus-scrape"] = {"permissions": [scrape], "principals": [
            {"authenticated": {"principal_name": {"exact": "prometheus"}}}]}
    return {"name": "envoy.filters.http.rbac", "typed_config": _any(
        "envoy.extensions.filters.http.rbac.v3.RBAC", rules={"action": "ALLOW", "policies": policies})}


def _rbac_network(peers: tuple[str, ...], prefix: str) -> dict:
    return {"name": "envoy.filters.network.rbac", "typed_config": _any(
        "envoy.extensions.filters.network.rbac.v3.RBAC", stat_prefix=prefix, rules={
            "action": "ALLOW", "policies": {"peers": {"permissions": [{"any": True}], "principals": [
                {"authenticated": {"principal_name": {"exact": p}}} for p in peers]}}})}


def _tcp_proxy(prefix: str, cluster: str) -> dict:
    # idle_timeout 0s: the ZMQ link may be quiet for hours; TCP keepalive finds dead peers.
    return {"name": "envoy.filters.network.tcp_proxy", "typed_config": _any(
        "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy", stat_prefix=prefix, cluster=cluster,
        idle_timeout="0s")}


KEEPALIVE = {"tcp_keepalive": {"keepalive_probes": 3, "keepalive_time": 30, "keepalive_interval": 10}}


# ---- one sidecar -----------------------------------------------------------------------

def build(s: Sidecar) -> dict:
    listeners, clusters = [], []
    me = s.identity

    # Ingress on the mesh port: gRPC to the service, /metrics to its Prometheus listener.
    ingress_routes = [
        {"match": {"path": "/metrics"}, "route": {"cluster": "local_metrics", "timeout": "10s"}},
        {"match": {"path": "/stats/prometheus"}, "route": {"cluster": "envoy_admin", "timeout": "10s"}},
        *[{"match": {"path": path}, "route": {"cluster": f"local_metrics_{port}", "timeout": "10s",
                                               "prefix_rewrite": "/metrics"}} for path, port in s.extra_metrics],
        _stream_route({"prefix": "/"}, "local_app", bound_s=None),
    ]
    listeners.append({
        "name": "mesh_ingress", "address": _addr("0.0.0.0", MESH_PORT),
        "per_connection_buffer_limit_bytes": 1048576,
        # AUTO: peers' sidecars speak HTTP/2; Prometheus scrapes over HTTP/1.1.
        "filter_chains": [{"filters": [_hcm("mesh_ingress", ingress_routes, codec="AUTO", idle_s=0,
                                            http_filters=[_rbac_http(s.peers, s.extra_metrics)],
                                            extra_hosts=[{"name": f"local_{authority}", "domains": [authority],
                                                          "routes": [_stream_route({"prefix": "/"}, f"local_{port}",
                                                                                   bound_s=None)]}
                                                         for authority, port in s.local_hosts])],
                           "transport_socket": _downstream_mtls(me, ["h2", "http/1.1"])}]})
    clusters.append(_cluster("local_app", [("127.0.0.1", s.app_port)], dns=False,
                             options=_h2_options(keepalive=True), max_requests=8192))
    for _, port in s.local_hosts:
        clusters.append(_cluster(f"local_{port}", [("127.0.0.1", port)], dns=False,
                                 options=_h2_options(keepalive=True), max_requests=8192))
    for _, port in s.extra_metrics:
        clusters.append(_cluster(f"local_metrics_{port}", [("127.0.0.1", port)], dns=False, options=_h1_options(),
                                 max_requests=64))
    clusters.append(_cluster("local_metrics", [("127.0.0.1", s.metrics_port)], dns=False, options=_h1_options(),
                             max_requests=64))
    clusters.append(_cluster("envoy_admin", [("127.0.0.1", ADMIN_PORT)], dns=False, options=_h1_options(),
                             max_requests=64))

    # Egress: the service's plain gRPC to a peer, mTLS from here on.
    for e in s.egress:
        routes = [*_retry_routes(e.cluster), _stream_route({"prefix": "/"}, e.cluster, bound_s=None)]
        if e.authority:
            for r in routes:
                r["route"]["host_rewrite_literal"] = e.authority
        listeners.append({"name": f"egress_{e.cluster}", "address": _addr("127.0.0.1", e.local_port),
                          "per_connection_buffer_limit_bytes": 1048576,
                          "filter_chains": [{"filters": [_hcm(f"egress_{e.cluster}", routes, codec="HTTP2",
                                                              idle_s=0, http_filters=[])]}]})
        clusters.append(_cluster(e.cluster, [(h, MESH_PORT) for h in e.hosts], dns=True,
                                 options=_h2_options(keepalive=True), tls=_upstream_mtls(me, e.identity, ["h2"]),
                                 outlier=True, health_service=e.health_service))

    # OTLP traces: the service exports to 127.0.0.1:4317, the collector is on the mesh network.
    otlp_routes = [_stream_route({"prefix": "/"}, "otel_collector", bound_s=60)]
    listeners.append({"name": "egress_otlp", "address": _addr("127.0.0.1", OTLP_PORT),
                      "filter_chains": [{"filters": [_hcm("egress_otlp", otlp_routes, codec="HTTP2", idle_s=300,
                                                          http_filters=[])]}]})
    clusters.append(_cluster("otel_collector", [("otel-collector", OTLP_PORT)], dns=True,
                             options=_h2_options(keepalive=False), max_requests=256, outlier=True))

    if s.zmq_to_worker:  # scheduler: ZMQ (not HTTP/2) to the worker, as TLS-wrapped TCP
        listeners.append({"name": "egress_worker_zmq", "address": _addr("127.0.0.1", WORKER_ZMQ_PORT),
                          "filter_chains": [{"filters": [_tcp_proxy("egress_worker_zmq", "worker_zmq")]}]})
        zc = _cluster("worker_zmq", [("worker", ZMQ_MESH_PORT)], dns=True, tls=_upstream_mtls(me, "worker", None),
                      max_requests=16)
        zc["upstream_connection_options"] = KEEPALIVE
        clusters.append(zc)
    if s.zmq_from:  # worker: accept the scheduler's ZMQ link over mTLS
        listeners.append({"name": "zmq_ingress", "address": _addr("0.0.0.0", ZMQ_MESH_PORT),
                          "filter_chains": [{"filters": [_rbac_network(s.zmq_from, "zmq_ingress"),
                                                         _tcp_proxy("zmq_ingress", "local_zmq")],
                                             "transport_socket": _downstream_mtls(me, None)}]})
        zc = _cluster("local_zmq", [("127.0.0.1", WORKER_ZMQ_PORT)], dns=False, max_requests=16)
        zc["upstream_connection_options"] = KEEPALIVE
        clusters.append(zc)

    if s.public:  # gateway: the one listener published to the host
        public_routes = [
            {"match": {"path": "/metrics"}, "direct_response": {"status": 404}},
            _stream_route({"prefix": "/", "grpc": {}}, "gateway_grpc", bound_s=PUBLIC_MAX_STREAM_S),
            _stream_route({"prefix": "/"}, "gateway_http", bound_s=PUBLIC_MAX_STREAM_S),
        ]
        tls = {"name": "envoy.transport_sockets.tls", "typed_config": _any(
            "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            common_tls_context={"tls_params": TLS_PARAMS, "alpn_protocols": ["h2", "http/1.1"],
                                "tls_certificates": [{
                                    "certificate_chain": {"filename": f"{PUBLIC_TLS_DIR}/tls.crt"},
                                    "private_key": {"filename": f"{PUBLIC_TLS_DIR}/tls.key"}}]})}
        listeners.append({
            "name": "public", "address": _addr("0.0.0.0", PUBLIC_PORT),
            "per_connection_buffer_limit_bytes": 1048576,
            "filter_chains": [{"filters": [_hcm("public", public_routes, codec="AUTO", idle_s=300,
                                                http_filters=[], public=True)], "transport_socket": tls}]})
        clusters.append(_cluster("gateway_grpc", [("127.0.0.1", APP_PORTS["gateway"])], dns=False,
                                 options=_h2_options(keepalive=False), max_requests=8192))
        clusters.append(_cluster("gateway_http", [("127.0.0.1", GATEWAY_HTTP_PORT)], dns=False,
                                 options=_h1_options(), max_requests=8192))

    return {
        "node": {"id": me, "cluster": "meshllm"},
        "admin": {"address": _addr("127.0.0.1", ADMIN_PORT)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "overload_manager": {
            "refresh_interval": "0.25s",
            "resource_monitors": [
                {"name": "envoy.resource_monitors.fixed_heap", "typed_config": _any(
                    "envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    max_heap_size_bytes=536870912)},
                {"name": "envoy.resource_monitors.global_downstream_max_connections", "typed_config": _any(
                    "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    max_active_downstream_connections=20000)}],
            "actions": [
                {"name": "envoy.overload_actions.shrink_heap", "triggers": [
                    {"name": "envoy.resource_monitors.fixed_heap", "threshold": {"value": 0.90}}]},
                {"name": "envoy.overload_actions.stop_accepting_requests", "triggers": [
                    {"name": "envoy.resource_monitors.fixed_heap", "threshold": {"value": 0.98}}]}]},
    }


HEADER = ("# Generated by deploy/compose/envoy/generate.py; do not edit (edit the script and rerun it).\n"
          "# Envoy v3 static bootstrap of the {name} sidecar.\n")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # plain YAML: no &anchors / *aliases
        return True


def render_all() -> dict[str, str]:
    return {f"{s.identity}.yaml": HEADER.format(name=s.identity)
            + yaml.dump(build(s), Dumper=_Dumper, sort_keys=False, width=200) for s in SIDECARS}


# Services that serve /metrics (the others would only show as down targets).
SCRAPED = ("gateway", "tokenizer", "scheduler", "worker", "embedder", "supervisor", "profiler", "kvstore")
PROMETHEUS_PATH = HERE.parent / "prometheus.yml"


def prometheus_config() -> str:
    """Prometheus scrapes every sidecar's mesh port with its own client certificate: /metrics
    of the service behind it (SCRAPED only) and /stats/prometheus of the sidecar itself."""
    jobs = []
    for s in SIDECARS:
        tls = {"ca_file": f"{CERT_DIR}/ca.pem", "cert_file": f"{CERT_DIR}/prometheus.pem",
               "key_file": f"{CERT_DIR}/prometheus.key", "server_name": s.identity}
        targets = [{"targets": [f"{h}:{MESH_PORT}" for h in HOSTS.get(s.identity, (s.identity,))],
                    "labels": {"service": s.identity}}]
        if s.identity in SCRAPED:
            jobs.append({"job_name": f"meshllm-{s.identity}", "scheme": "https", "metrics_path": "/metrics",
                         "tls_config": tls, "static_configs": targets})
        for path, _ in s.extra_metrics:  # processes the supervisor runs (engine-1)
            name = path.removeprefix("/metrics/").replace("/", "-")
            jobs.append({"job_name": f"meshllm-{name}", "scheme": "https", "metrics_path": path,
                         "tls_config": tls, "static_configs": [{"targets": targets[0]["targets"],
                                                                "labels": {"service": name.rsplit("-", 1)[1]}}]})
        jobs.append({"job_name": f"envoy-{s.identity}", "scheme": "https", "metrics_path": "/stats/prometheus",
                     "tls_config": tls, "static_configs": targets})
    cfg = {"global": {"scrape_interval": "15s", "scrape_timeout": "10s", "evaluation_interval": "15s"},
           "scrape_configs": [{"job_name": "prometheus", "static_configs": [{"targets": ["127.0.0.1:9090"]}]},
                              *jobs]}
    return ("# Generated by deploy/compose/envoy/generate.py; do not edit.\n"
            "# Every target is a sidecar's mTLS mesh port; Prometheus presents the dev CA's `prometheus`\n"
            "# certificate, which the sidecars' RBAC admits for /metrics and /stats/prometheus only.\n"
            + yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, width=200))


def main() -> int:
    outputs = {HERE / name: text for name, text in render_all().items()}
    outputs[PROMETHEUS_PATH] = prometheus_config()
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
