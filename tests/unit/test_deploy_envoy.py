"""The Envoy sidecar configs of deploy/compose (docker-compose.yml's in envoy/, the ones only the
prefill/decode variant adds in envoy/pd/): fresh, valid against Envoy's v3 API, and shaped for
LLM traffic (no timeouts that cut streams, bounded public streams, retries only for idempotent
calls, limits everywhere, admin on loopback)."""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import yaml

from tests.unit.deploy_tools import (ENVOY_DIR, PD_ENVOY_DIR, ROOT, all_envoy_configs, envoy_configs,
                                     envoy_generator, envoy_pd_generator, xds_protos_dir)

CHECKER = ROOT / "tests" / "unit" / "envoy_schema_check.py"


def _schema_check(paths) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(xds_protos_dir())}
    return subprocess.run([sys.executable, str(CHECKER), *map(str, paths)], capture_output=True, text=True,
                          timeout=120, env=env)


def _walk(node, path=""):
    """Every (path, dict) in a nested structure."""
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def _hcms(boot):
    for listener in boot["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    yield listener, f["typed_config"]


def test_committed_configs_are_what_the_generator_writes():
    gen = envoy_generator()
    expected = gen.render_all()
    on_disk = {p.name: p.read_text() for p in ENVOY_DIR.glob("*.yaml")}
    assert on_disk == expected, "deploy/compose/envoy is stale: run python deploy/compose/envoy/generate.py"
    assert gen.PROMETHEUS_PATH.read_text() == gen.prometheus_config()


def test_committed_pd_configs_are_what_the_pd_generator_writes():
    pd = envoy_pd_generator()
    expected = pd.render_all()
    on_disk = {p.name: p.read_text() for p in PD_ENVOY_DIR.glob("*.yaml")}
    assert on_disk == expected, "deploy/compose/envoy/pd is stale: run python deploy/compose/envoy/pd/generate.py"
    assert pd.PROMETHEUS_PATH.read_text() == pd.prometheus_config()
    # every file a PD sidecar mounts exists: its own here, or docker-compose.yml's
    for host, name in pd.CONFIG_FILES.items():
        assert (ENVOY_DIR / name).is_file(), (host, name)


def test_every_config_parses_into_envoy_v3_bootstrap_with_typed_configs_and_validation_rules():
    paths = [ENVOY_DIR / name for name in all_envoy_configs()]
    assert any(p.parent == PD_ENVOY_DIR for p in paths) and any(p.parent == ENVOY_DIR for p in paths)
    r = _schema_check(paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"checked {len(paths)} Envoy configs: 0 problems" in r.stdout


def test_the_schema_check_rejects_broken_configs(tmp_path):
    """The check is not just YAML: a typo, a missing route action, an unknown typed_config
    and a bad enum are each caught."""
    boot = yaml.safe_load((ENVOY_DIR / "worker.yaml").read_text())
    hcm = next(_hcms(boot))[1]
    breakages = {
        "typo": lambda b: b["static_resources"]["clusters"][0].update(connect_timout="1s"),
        "no_action": lambda b: next(_hcms(b))[1]["route_config"]["virtual_hosts"][0]["routes"][0].pop("route"),
        "unknown_any": lambda b: next(_hcms(b))[1].update({"@type": "type.googleapis.com/envoy.Nope"}),
        "bad_enum": lambda b: next(_hcms(b))[1].update(codec_type="HTTP9"),
        "empty_cluster_name": lambda b: b["static_resources"]["clusters"][0].update(name=""),
    }
    assert hcm["codec_type"] == "AUTO"
    paths = []
    for name, breakage in breakages.items():
        broken = copy.deepcopy(boot)
        breakage(broken)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(broken))
        paths.append(path)
    r = _schema_check(paths)
    assert r.returncode == 1
    for path in paths:
        assert str(path) in r.stdout, f"{path.name} was not caught:\n{r.stdout}"


def test_admin_is_bound_to_loopback_and_overload_manager_is_on():
    for name, boot in all_envoy_configs().items():
        assert boot["admin"]["address"]["socket_address"]["address"] == "127.0.0.1", name
        om = boot["overload_manager"]
        monitors = {m["name"] for m in om["resource_monitors"]}
        assert {"envoy.resource_monitors.fixed_heap",
                "envoy.resource_monitors.global_downstream_max_connections"} <= monitors, name
        actions = {a["name"] for a in om["actions"]}
        assert "envoy.overload_actions.stop_accepting_requests" in actions, name


def test_routes_never_time_out_streams_and_public_streams_are_bounded():
    gen = envoy_generator()
    for name, boot in all_envoy_configs().items():
        for listener, hcm in _hcms(boot):
            assert hcm["http2_protocol_options"]["max_concurrent_streams"] > 0, (name, listener["name"])
            assert hcm["http2_protocol_options"]["initial_stream_window_size"] > 0
            for vh in hcm["route_config"]["virtual_hosts"]:
                for route in vh["routes"]:
                    action = route.get("route")
                    if action is None or "retry_policy" in action or action["cluster"].startswith(
                            ("local_metrics", "envoy_admin")):
                        continue  # unary control calls and scrapes have a finite timeout
                    assert action["timeout"] == "0s", (name, listener["name"], route)
                    if listener["name"] == "public":
                        bound = action["max_stream_duration"]["max_stream_duration"]
                        assert bound == f"{gen.PUBLIC_MAX_STREAM_S}s", (name, route)


def test_only_idempotent_control_calls_are_retried():
    gen = envoy_generator()
    retried = 0
    for name, boot in all_envoy_configs().items():
        for listener, hcm in _hcms(boot):
            for vh in hcm["route_config"]["virtual_hosts"]:
                for route in vh["routes"]:
                    if "retry_policy" not in route.get("route", {}):
                        continue
                    retried += 1
                    regex = re.compile(route["match"]["safe_regex"]["regex"])
                    for call in gen.IDEMPOTENT_PATHS:
                        assert regex.fullmatch(call)
                    for call in ("/meshllm.v1.Generation/Generate", "/meshllm.v1.Engine/EngineStream",
                                 "/meshllm.v1.Tokenizer/Detokenize", "/meshllm.v1.Tokenizer/Encode",
                                 "/meshllm.v1.Supervisor/Drain", "/meshllm.v1.ProfilerControl/Start"):
                        assert not regex.fullmatch(call), (name, listener["name"], call)
    assert retried > 0
    for name, boot in all_envoy_configs().items():  # nowhere else: no retry policy outside routes
        assert sum("retry_policy" in node for _, node in _walk(boot)) == sum(
            "retry_policy" in r.get("route", {}) for _, h in _hcms(boot)
            for vh in h["route_config"]["virtual_hosts"] for r in vh["routes"]), name


def test_clusters_have_circuit_breakers_and_remote_ones_outlier_detection_and_mtls():
    for name, boot in all_envoy_configs().items():
        for c in boot["static_resources"]["clusters"]:
            limits = c["circuit_breakers"]["thresholds"][0]
            assert limits["max_requests"] > 0 and limits["max_pending_requests"] > 0, (name, c["name"])
            if c["name"].endswith("_mesh") or c["name"] == "worker_zmq":
                tls = c["transport_socket"]["typed_config"]
                assert tls["@type"].endswith("UpstreamTlsContext")
                assert tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
            if c["name"].endswith("_mesh"):
                assert c["outlier_detection"]["consecutive_5xx"] > 0, (name, c["name"])


def test_every_non_loopback_listener_requires_client_certificates_except_the_public_one():
    for name, boot in all_envoy_configs().items():
        for listener in boot["static_resources"]["listeners"]:
            addr = listener["address"]["socket_address"]["address"]
            if addr == "127.0.0.1":
                continue
            for chain in listener["filter_chains"]:
                tls = chain["transport_socket"]["typed_config"]
                assert tls["@type"].endswith("DownstreamTlsContext"), (name, listener["name"])
                if listener["name"] != "public":
                    assert tls["require_client_certificate"] is True, (name, listener["name"])
                    names = {f["name"] for f in chain["filters"]}
                    hcm_filters = {h["name"] for f in chain["filters"]
                                   for h in f.get("typed_config", {}).get("http_filters", [])}
                    assert "envoy.filters.network.rbac" in names or "envoy.filters.http.rbac" in hcm_filters


def test_the_scheduler_to_worker_zmq_hop_is_tls_wrapped_tcp():
    configs = envoy_configs()
    sched = {x["name"]: x for x in configs["scheduler"]["static_resources"]["listeners"]}
    proxy = sched["egress_worker_zmq"]["filter_chains"][0]["filters"][0]
    assert proxy["name"] == "envoy.filters.network.tcp_proxy"
    worker = {x["name"]: x for x in configs["worker"]["static_resources"]["listeners"]}
    chain = worker["zmq_ingress"]["filter_chains"][0]
    assert chain["transport_socket"]["typed_config"]["require_client_certificate"] is True
    rbac = chain["filters"][0]["typed_config"]["rules"]["policies"]["peers"]["principals"]
    assert [p["authenticated"]["principal_name"]["exact"] for p in rbac] == ["scheduler"]


def _egress(boot: dict) -> dict[int, tuple[str, tuple, str]]:
    """Loopback port -> (cluster, its (host, port) endpoints, the identity its certificate must name)."""
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    out = {}
    for lst in boot["static_resources"]["listeners"]:
        sa = lst["address"]["socket_address"]
        if sa["address"] != "127.0.0.1":
            continue
        f = lst["filter_chains"][0]["filters"][0]["typed_config"]
        name = f.get("cluster") or f["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["cluster"]
        c = clusters[name]
        hosts = tuple((e["endpoint"]["address"]["socket_address"]["address"],
                       e["endpoint"]["address"]["socket_address"]["port_value"])
                      for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"])
        sans = c.get("transport_socket", {}).get("typed_config", {}).get("common_tls_context", {}).get(
            "validation_context", {}).get("match_typed_subject_alt_names", [])
        out[sa["port_value"]] = (name, hosts, sans[0]["matcher"]["exact"] if sans else None)
    return out


def test_pd_sidecars_reach_each_engine_on_its_own_and_the_decode_scheduler_its_own_worker():
    """docker-compose.pd.yml: the gateway's sidecar has one egress per engine (a single scheduler
    behind each, never the two balanced as one); the decode scheduler's ZMQ goes to the decode
    worker only; nothing routes to the supervisor, which this variant does not start."""
    gen, pd = envoy_generator(), envoy_pd_generator()
    configs = all_envoy_configs()
    schedulers = [s for s, _ in pd.ENGINES.values()]
    gw = _egress(configs["pd/gateway.yaml"])
    engines = {port: hosts for port, (_, hosts, san) in gw.items() if san == "scheduler"}
    assert sorted(engines.values()) == sorted(((s, gen.MESH_PORT),) for s in schedulers), engines
    assert sorted(engines) == [gen.APP_PORTS["scheduler"] + 100 * i for i in range(len(schedulers))]
    for name in ("pd/gateway.yaml", "pd/profiler.yaml", "pd/decode-scheduler.yaml"):
        assert "supervisor" not in yaml.safe_dump(configs[name]), f"{name} still routes to the supervisor"
    # the gateway's other egress is docker-compose.yml's gateway's
    base_gw = _egress(configs["gateway.yaml"])
    assert {p: e for p, e in gw.items() if e[2] != "scheduler"} == {
        p: e for p, e in base_gw.items() if e[2] not in ("scheduler", "supervisor")}
    # ZMQ: prefill scheduler -> prefill worker (docker-compose.yml's scheduler.yaml), decode -> decode
    for role, (sched, worker) in pd.ENGINES.items():
        zmq = _egress(configs[pd.CONFIG_FILES[sched]])[gen.WORKER_ZMQ_PORT]
        assert zmq[1:] == (((worker, gen.ZMQ_MESH_PORT),), "worker"), (role, zmq)
    # the profiler reaches every replica of both engines, each on its own port
    prof = _egress(configs["pd/profiler.yaml"])
    for identity in ("scheduler", "worker"):
        hosts = sorted(h for _, hs, san in prof.values() if san == identity for h, _ in hs)
        assert hosts == sorted(pd.HOSTS[identity]), (identity, hosts)
    assert all(len(hs) == 1 for _, hs, san in prof.values() if san), prof
