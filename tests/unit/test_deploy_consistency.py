"""deploy/ agrees with the code: every server service is deployed in compose and on
Kubernetes, every deployed command line parses with that service's own argument parser and
config validation, and the ports and addresses line up across the service configs, the
Envoy sidecars, docker-compose and the Kubernetes manifests. A change on either side that
is not made on the other fails here. The prefill/decode variants (docker-compose.pd.yml,
overlays/pd and pd-mtls) are held to the same checks, and to their roles."""
from __future__ import annotations

import importlib
import logging
import pathlib
import re

import pytest

from tests.unit.deploy_tools import (COMPOSE_DIR, K8S_DIR, ROOT, compose_config, envoy_configs, envoy_generator,
                                     kustomize, mounted_envoy_config, probe_target)

COMPOSE_VARIANTS = {"base": ("docker-compose.yml",), "pd": ("docker-compose.yml", "docker-compose.pd.yml")}
K8S_OVERLAYS = ("cpu", "gpu", "cpu-mtls", "pd", "pd-mtls")
K8S_PD_OVERLAYS = ("pd", "pd-mtls")  # overlays/pd, and it with components/internal-mtls
# Server services a variant deliberately does not run: prefill/decode has no supervisor (its
# engine-1 would be a third, colocated engine the gateway does not route to).
PARKED = {"pd": {"supervisor"}, "pd-mtls": {"supervisor"}}

IMAGE_PATHS = {  # paths inside the image -> what stands for them here
    "/opt/meshllm/models/smollm2-135m-instruct": "smollm2",
    "/opt/meshllm/models/all-minilm-l6-v2": "minilm",
    "/etc/meshllm/supervisor-spec.json": "compose-spec",
    "/etc/meshllm/spec/supervisor-spec.json": "k8s-spec",
    "/var/lib/meshllm/profiles": "profiles",
}


def server_services() -> set[str]:
    """Packages under services/ that run on their own (`__main__.py`) and serve gRPC."""
    found = set()
    for main in (ROOT / "services").glob("*/__main__.py"):
        if any("make_server(" in p.read_text() for p in main.parent.glob("*.py")):
            found.add(main.parent.name)
    return found


@pytest.fixture(scope="module")
def local_paths(smollm2_dir, minilm_dir, tmp_path_factory):
    profiles = tmp_path_factory.mktemp("profiles")
    k8s_spec = tmp_path_factory.mktemp("spec") / "supervisor-spec.json"
    return {"smollm2": str(smollm2_dir), "minilm": str(minilm_dir), "profiles": str(profiles),
            "compose-spec": str(COMPOSE_DIR / "supervisor-spec.json"), "k8s-spec": str(k8s_spec)}


def parse_service(module: str, argv: list[str], local_paths: dict[str, str]):
    """The service's own parse (flags + config validation) of a deployed command line."""
    from services.common import telemetry

    args = []
    for a in argv:
        for image_path, key in IMAGE_PATHS.items():
            a = a.replace(image_path, local_paths[key])
        args.append(a)
    rest, _tracing = telemetry.split_tracing_args(module, args)
    main = importlib.import_module(f"services.{module}.main")
    root = logging.getLogger()
    saved = root.handlers[:], root.level  # some parsers set up the service's logging: undo it
    try:
        if hasattr(main, "parse_args"):
            return main.parse_args(rest)
        return main._parser().parse_args(rest)  # the tokenizer builds its config in main()
    except SystemExit as exc:
        pytest.fail(f"{module} refuses its deployed flags {argv}: exit {exc.code} (see stderr)")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def grpc_port(module: str, cfg) -> int:
    return cfg.grpc_port if module in ("gateway", "worker") else cfg.port


def hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def service_identity(name: str) -> str:
    """The identity behind a profiler target name: `tokenizer-2`, `scheduler-0`,
    `decode-scheduler`, `prefill-scheduler-0` -> tokenizer, scheduler, scheduler, scheduler."""
    return re.sub(r"^(prefill|decode)-", "", re.sub(r"(-\d+)+$", "", name))


def outbound(module: str, cfg) -> list[tuple[str, str]]:
    """(address, identity expected behind it) for every peer the service calls."""
    out = []
    if module == "gateway":
        out += [(a, "tokenizer") for a in cfg.tokenizer_addrs]
        out += [(a, "scheduler") for a in cfg.engine_addrs]
        out += [(a, n) for a, n in ((cfg.embedder_addr, "embedder"), (cfg.profiler_addr, "profiler"),
                                    (cfg.supervisor_addr, "supervisor")) if a]
    elif module == "scheduler":
        out.append((cfg.worker_addr, "worker-zmq"))
    if module in ("scheduler", "worker") and cfg.kvstore_addr:
        out.append((cfg.kvstore_addr, "kvstore"))
    elif module == "profiler":
        out += [(addr, "worker") for _, addr in cfg.workers]
        out += [(addr, service_identity(name)) for name, addr in cfg.services]
        if cfg.gateway_addr:
            out.append((cfg.gateway_addr, "gateway"))
    return out


# ---- compose -----------------------------------------------------------------------------

def _compose_apps(cfg: dict, local_paths) -> dict:
    """compose service name -> (module, parsed config), for the services `up` starts."""
    apps = {}
    for name, svc in cfg["services"].items():
        if str(svc.get("network_mode", "")).startswith("service:") and not svc.get("profiles"):
            module, *argv = svc["command"]
            apps[name] = (module, parse_service(module, argv, local_paths))
    return apps


@pytest.fixture(scope="module", params=list(COMPOSE_VARIANTS))
def variant(request, local_paths):
    """(name, `docker-compose config`, apps) of docker-compose.yml alone and with the PD override."""
    cfg = compose_config(*COMPOSE_VARIANTS[request.param])
    return request.param, cfg, _compose_apps(cfg, local_paths)


def _sidecar_config(cfg: dict, name: str) -> dict:
    """The Envoy bootstrap compose service `name`'s sidecar really mounts."""
    return mounted_envoy_config(cfg, cfg["services"][name]["network_mode"].removeprefix("service:"))[1]


def _egress_map(boot: dict) -> dict[int, dict]:
    """Loopback port -> {"cluster", "san", "hosts"} of a sidecar's egress listeners."""
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    out = {}
    for lst in boot["static_resources"]["listeners"]:
        sa = lst["address"]["socket_address"]
        if sa["address"] != "127.0.0.1":
            continue
        f = lst["filter_chains"][0]["filters"][0]["typed_config"]
        if "cluster" in f:
            name = f["cluster"]
        else:
            name = f["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["cluster"]
        c = clusters[name]
        ts = c.get("transport_socket", {}).get("typed_config", {})
        sans = ts.get("common_tls_context", {}).get("validation_context", {}).get(
            "match_typed_subject_alt_names", [])
        hosts = [e["endpoint"]["address"]["socket_address"]
                 for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]]
        out[sa["port_value"]] = {"cluster": name, "san": sans[0]["matcher"]["exact"] if sans else None,
                                 "hosts": [(h["address"], h["port_value"]) for h in hosts]}
    return out


def _ingress_local_ports(boot: dict) -> set[int]:
    """Loopback ports the sidecar forwards mesh traffic to."""
    return {e["endpoint"]["address"]["socket_address"]["port_value"]
            for c in boot["static_resources"]["clusters"] if c["name"].startswith(("local_", "gateway_"))
            for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]}


def test_every_server_service_is_deployed_in_compose(variant):
    which, _, compose_apps = variant
    servers = server_services()
    assert {"gateway", "tokenizer", "scheduler", "worker", "embedder"} <= servers
    assert PARKED.get(which, set()) <= servers
    deployed = {module for module, _ in compose_apps.values()}
    wanted = servers - PARKED.get(which, set())
    assert wanted <= deployed, f"not in {which} compose: {sorted(wanted - deployed)}"
    assert deployed <= wanted, f"{which} compose runs non-servers or parked ones: {sorted(deployed - wanted)}"


def test_compose_services_listen_where_their_sidecars_forward(variant):
    gen = envoy_generator()
    _, compose, compose_apps = variant
    for name, (module, cfg) in compose_apps.items():
        assert cfg.host == "127.0.0.1", f"{name} listens beyond its sidecar: {cfg.host}"
        assert grpc_port(module, cfg) == gen.APP_PORTS[module], name
        local = _ingress_local_ports(_sidecar_config(compose, name))
        assert grpc_port(module, cfg) in local, (name, local)
        if module == "gateway":
            assert cfg.port == gen.GATEWAY_HTTP_PORT and cfg.port in local
        if module != "gateway":  # the gateway serves /metrics on its HTTP port
            if hasattr(cfg, "metrics_port"):  # the service can serve /metrics: compose must turn it on
                assert cfg.metrics_port == gen.METRICS_PORT and module in gen.SCRAPED, name
            else:
                assert module not in gen.SCRAPED, f"Prometheus scrapes {name}, which has no --metrics-port"
        if module == "worker":
            assert hostport(cfg.zmq_addr) == ("127.0.0.1", gen.WORKER_ZMQ_PORT)


def test_compose_services_call_peers_through_sidecar_egress_to_the_right_identity(variant):
    gen = envoy_generator()
    _, compose, compose_apps = variant
    by_host = {name: module for name, (module, _) in compose_apps.items()}
    checked = 0
    for name, (module, cfg) in compose_apps.items():
        egress = _egress_map(_sidecar_config(compose, name))
        for addr, identity in outbound(module, cfg):
            host, port = hostport(addr)
            assert host == "127.0.0.1", f"{name} calls {addr} directly, not through its sidecar"
            assert port in egress, f"{name} calls {addr}, but its sidecar has no egress there"
            e = egress[port]
            if identity == "worker-zmq":  # the worker of this scheduler's own engine (same engine id)
                assert e["san"] == "worker" and len(e["hosts"]) == 1, (name, e)
                (worker, zmq_port), = e["hosts"]
                assert zmq_port == gen.ZMQ_MESH_PORT and by_host.get(worker) == "worker", (name, e)
                assert compose_apps[worker][1].engine_id == cfg.engine_id, f"{name} drives {worker}, another engine"
                continue
            if identity == "scheduler" and e["san"] == "supervisor":
                identity = "supervisor"  # the supervisor's own engine (engine-1)
            assert e["san"] == identity, f"{name}: {addr} reaches {e['san']}, expected {identity}"
            for h, p in e["hosts"]:
                assert p == gen.MESH_PORT and by_host.get(h) == identity, (name, addr, h)
            checked += 1
        if module == "profiler":  # a target named after a replica reaches that replica
            for target, addr in [*cfg.services, *cfg.workers]:
                if target in by_host:
                    assert egress[hostport(addr)[1]]["hosts"] == [(target, gen.MESH_PORT)], (target, addr)
    assert checked >= 8


def test_compose_health_checks_ask_each_service_for_its_readiness(variant):
    _, compose, compose_apps = variant
    for name, (module, cfg) in compose_apps.items():
        test = compose["services"][name]["healthcheck"]["test"]
        assert test == ["CMD", "meshllm", "health", "--addr", f"127.0.0.1:{grpc_port(module, cfg)}",
                        "--service", module], name


def _spec_processes(path: pathlib.Path):
    from services.supervisor.config import load_spec
    spec = load_spec(str(path))
    return [(r, p) for r in spec.replicas for p in r.processes]


@pytest.mark.parametrize("where", ["compose", "k8s-cpu", "k8s-gpu"])
def test_supervisor_specs_parse_with_each_process_own_flags(where, local_paths):
    gen = envoy_generator()
    path = {"compose": COMPOSE_DIR / "supervisor-spec.json", "k8s-cpu": K8S_DIR / "base" / "supervisor-spec.json",
            "k8s-gpu": K8S_DIR / "overlays" / "gpu" / "supervisor-spec.json"}[where]
    procs = _spec_processes(path)
    assert procs
    for replica, p in procs:
        cfg = parse_service(p.module, list(p.args), local_paths)
        assert p.health_service == p.module
        assert hostport(p.health_addr)[1] == grpc_port(p.module, cfg), (replica.id, p.module)
        if p.module == "scheduler":
            assert grpc_port("scheduler", cfg) == gen.SUPERVISED_ENGINE_PORT
            assert hostport(replica.addr)[1] == gen.SUPERVISED_ENGINE_PORT
        if hasattr(cfg, "metrics_port"):  # served, and published on the supervisor's mesh port
            assert cfg.metrics_port in {port for _, port in gen.SUPERVISED_METRICS}, (replica.id, p.module)
    supervisor = envoy_configs()["supervisor"]
    assert gen.SUPERVISED_ENGINE_PORT in _ingress_local_ports(supervisor)


# ---- kubernetes --------------------------------------------------------------------------

def _k8s(overlay: str, local_paths) -> tuple[list[dict], list]:
    docs = kustomize(K8S_DIR / "overlays" / overlay)
    spec_cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("meshllm-supervisor-spec")]
    assert len(spec_cm) == (0 if "supervisor" in PARKED.get(overlay, ()) else 1), overlay
    if spec_cm:
        pathlib.Path(local_paths["k8s-spec"]).write_text(spec_cm[0]["data"]["supervisor-spec.json"])
    containers = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                module, *argv = c["args"]
                containers.append((d, c, module, parse_service(module, argv, local_paths)))
    return docs, containers


@pytest.fixture(scope="module", params=K8S_OVERLAYS)
def k8s(request, local_paths):
    """(overlay, rendered documents, [(workload, container, module, parsed config)])."""
    return (request.param, *_k8s(request.param, local_paths))


def test_every_server_service_is_deployed_on_kubernetes(k8s):
    overlay, _, containers = k8s
    deployed = {module for _, _, module, _ in containers}
    wanted = server_services() - PARKED.get(overlay, set())
    assert wanted <= deployed, f"not in deploy/k8s/overlays/{overlay}: {sorted(wanted - deployed)}"
    assert not deployed & PARKED.get(overlay, set()), (overlay, deployed)


def test_k8s_containers_listen_on_the_same_ports_as_compose_and_probe_them(k8s):
    gen = envoy_generator()
    _, _, containers = k8s
    for w, c, module, cfg in containers:
        where = f"{w['metadata']['name']}/{c['name']}"
        assert cfg.host == "0.0.0.0", where
        port = grpc_port(module, cfg)
        assert port == gen.APP_PORTS[module], where
        declared = {p["containerPort"] for p in c["ports"]}
        assert port in declared, where
        assert probe_target(c["livenessProbe"]) == (port, ""), where
        ready = probe_target(c["readinessProbe"])
        if module == "supervisor":  # ready when its engine is: the engine's scheduler
            assert ready == (gen.SUPERVISED_ENGINE_PORT, "scheduler"), where
            assert gen.SUPERVISED_ENGINE_PORT in declared
        else:
            assert ready == (port, module), where
        if hasattr(cfg, "metrics_port"):
            assert cfg.metrics_port in declared, f"{where}: /metrics port {cfg.metrics_port} not declared"


def _monitoring_ports(docs, app: str) -> set[int]:
    """Ports of pods labelled `app` that the NetworkPolicies open to the monitoring namespace."""
    ports = set()
    for d in docs:
        if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"].get("matchLabels", {}).get(
                "app.kubernetes.io/name") == app:
            for rule in d["spec"].get("ingress", []):
                if any("namespaceSelector" in f for f in rule.get("from", [])):
                    ports |= {p["port"] for p in rule["ports"]}
    return ports


def test_k8s_metrics_ports_are_declared_annotated_and_open_to_monitoring(k8s, local_paths):
    _, docs, containers = k8s
    by_pod: dict[str, set[int]] = {}
    for w, c, module, cfg in containers:
        app = w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        ports = by_pod.setdefault(app, set())
        if module == "gateway":
            ports.add(cfg.port)
        elif hasattr(cfg, "metrics_port"):
            assert cfg.metrics_port, f"{app}/{c['name']} serves no /metrics on Kubernetes"
            ports.add(cfg.metrics_port)
        if module == "supervisor":  # and its engine's processes
            declared = {p["containerPort"] for p in c["ports"]}
            for _, p in _spec_processes(pathlib.Path(local_paths["k8s-spec"])):
                sub = parse_service(p.module, list(p.args), local_paths)
                if hasattr(sub, "metrics_port"):
                    assert sub.metrics_port in declared and sub.host == "0.0.0.0", p.module
                    ports.add(sub.metrics_port)
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        app = w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        ports = by_pod[app]
        if not ports:
            continue
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        assert int(annotations.get("prometheus.io/port", 0)) in ports, app
        if app != "gateway":  # the gateway admits everyone already
            assert ports <= _monitoring_ports(docs, app), (app, ports, _monitoring_ports(docs, app))


def _resolve(docs, host: str) -> tuple[dict, int | None]:
    """A k8s DNS name -> (its Service, StatefulSet ordinal or None)."""
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    m = re.fullmatch(r"([a-z0-9-]+)-(\d+)\.([a-z0-9-]+)", host)
    if m:
        sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == m.group(1))
        assert sts["spec"]["serviceName"] == m.group(3)
        assert int(m.group(2)) < sts["spec"]["replicas"], f"{host}: the StatefulSet has fewer replicas"
        return services[m.group(3)], int(m.group(2))
    assert host in services, f"no Service named {host}"
    return services[host], None


def test_k8s_addresses_resolve_to_services_that_reach_the_right_container(k8s):
    _, docs, containers = k8s
    listening = []  # (pod labels, port, module)
    for w, c, module, cfg in containers:
        labels = w["spec"]["template"]["metadata"]["labels"]
        listening.append((labels, grpc_port(module, cfg), module))
        if module == "supervisor":
            listening.append((labels, envoy_generator().SUPERVISED_ENGINE_PORT, "scheduler"))
    checked = 0
    for w, c, module, cfg in containers:
        for addr, identity in outbound(module, cfg):
            host, port = hostport(addr)
            if identity == "worker-zmq":  # same pod, over loopback
                assert host == "127.0.0.1"
                pod = w["spec"]["template"]["spec"]["containers"]
                zmq = [hostport(a.split("=", 1)[1]) for x in pod for a in x["args"] if a.startswith("--zmq-addr=")]
                assert zmq == [("127.0.0.1", port)], (w["metadata"]["name"], zmq)
                continue
            svc, _ = _resolve(docs, host)
            ports = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
            assert port in ports, f"{module} calls {addr}; Service {host} has ports {sorted(ports)}"
            selector = svc["spec"]["selector"]
            behind = {m for labels, p, m in listening
                      if p == port and all(labels.get(k) == v for k, v in selector.items())}
            assert identity in behind, f"{module} calls {addr} for {identity}, which reaches {behind}"
            checked += 1
    assert checked >= 7


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admitted(docs, callee: dict, caller: dict, port: int) -> bool:
    """Whether some NetworkPolicy selecting pods labelled `callee` lets pods labelled `caller`
    (same namespace) in on container port `port`."""
    for pol in (d for d in docs if d["kind"] == "NetworkPolicy"):
        if not _matches(pol["spec"]["podSelector"], callee):
            continue
        for rule in pol["spec"].get("ingress", []):
            if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
                continue
            if not rule.get("from") or any("podSelector" in f and "namespaceSelector" not in f
                                           and _matches(f["podSelector"], caller) for f in rule["from"]):
                return True
    return False


def test_k8s_network_policies_admit_every_call_the_services_make(k8s):
    """Every address a container dials (through its Service, to the container port behind it)
    is let in by the callee's NetworkPolicy for the caller's pods: in overlays/pd the gateway and
    the profiler reach both engines and both engines reach the kvstore."""
    overlay, docs, containers = k8s
    pods = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    checked = 0
    for w, c, module, cfg in containers:
        caller = w["spec"]["template"]["metadata"]["labels"]
        for addr, identity in outbound(module, cfg):
            if identity == "worker-zmq":  # the pod's loopback
                continue
            host, port = hostport(addr)
            svc, _ = _resolve(docs, host)
            target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == port)
            behind = [x for x in pods if all(x["spec"]["template"]["metadata"]["labels"].get(k) == v
                                            for k, v in svc["spec"]["selector"].items())]
            assert behind, f"{overlay}: Service {host} selects no pod"
            for x in behind:
                container_ports = {p["name"]: p["containerPort"] for y in x["spec"]["template"]["spec"]["containers"]
                                   for p in y["ports"]}
                pod_port = container_ports[target] if isinstance(target, str) else target
                callee = x["spec"]["template"]["metadata"]["labels"]
                assert _admitted(docs, callee, caller, pod_port), (
                    f"{overlay}: {w['metadata']['name']}/{c['name']} dials {addr}, which the NetworkPolicies "
                    f"of {x['metadata']['name']} do not admit on port {pod_port}")
                checked += 1
    assert checked >= 7


def test_k8s_and_compose_run_the_same_services_with_the_same_flags(k8s, local_paths):
    """Beyond addresses and devices, a service is configured alike in both (overlays/pd and pd-mtls like
    docker-compose.pd.yml, role by role; the others like docker-compose.yml)."""
    overlay, _, containers = k8s
    which = "pd" if overlay in K8S_PD_OVERLAYS else "base"
    compose = compose_config(*COMPOSE_VARIANTS[which])
    compose_apps = _compose_apps(compose, local_paths)
    ignore = re.compile(r"^--(host|tokenizer-addr|engine-addr|embedder-addr|profiler-addr|worker|service|"
                        r"gateway-addr|spec|device|kv-cache-memory-gb|engine-id|metrics-port|kvstore-addr)=")
    compose_flags = {}
    for name, (module, cfg) in compose_apps.items():
        argv = compose["services"][name]["command"][1:]
        compose_flags.setdefault((module, getattr(cfg, "kv_role", "")), {a for a in argv if not ignore.match(a)})
    for w, c, module, cfg in containers:
        k8s_flags = {a for a in c["args"][1:] if not ignore.match(a)}
        key = (module, getattr(cfg, "kv_role", ""))
        assert key in compose_flags, f"{overlay}: {key} has no counterpart in {which} compose"
        assert k8s_flags == compose_flags[key], (overlay, key, k8s_flags ^ compose_flags[key])


def test_the_dockerfiles_build_what_deploy_runs():
    for name, base_needed in (("Dockerfile", "cpu"), ("Dockerfile.cuda", None)):
        text = (ROOT / "deploy" / name).read_text()
        lines = [ln.strip() for ln in text.splitlines()]
        assert any(ln.startswith("FROM python:3.11-slim") for ln in lines), name
        torch = next(i for i, ln in enumerate(lines) if "pip install torch==2.13.0" in ln)
        reqs = next(i for i, ln in enumerate(lines) if "pip install -r requirements.txt" in ln)
        assert torch < reqs, f"{name}: torch must be installed before the requirements"
        if base_needed == "cpu":
            assert "download.pytorch.org/whl/cpu" in lines[torch]
        assert any("scripts/gen_protos.py" in ln for ln in lines), name
        assert any("meshllm models prepare smollm2" in ln for ln in lines), name
        user = [ln for ln in lines if ln.startswith("USER ")]
        assert user and not user[-1].split()[1].startswith(("0", "root")), name
        assert any(ln.startswith("HEALTHCHECK") for ln in lines)
        assert "meshllm health" in text
    entry = (ROOT / "deploy" / "entrypoint.sh").read_text()
    assert 'exec python -m "services.${service}"' in entry
    pinned = {ln.split("==")[0] for ln in (ROOT / "requirements.txt").read_text().splitlines() if "==" in ln}
    assert "torch" in pinned


def test_the_model_paths_deploy_uses_are_the_ones_the_images_prepare(smollm2_dir, minilm_dir):
    from services.models.prepare import MODELS
    # the Dockerfiles run `meshllm models prepare smollm2` and `... minilm` with MESHLLM_CACHE=/opt/meshllm
    assert {f"/opt/meshllm/models/{MODELS[k].name}" for k in ("smollm2", "minilm")} == {
        p for p in IMAGE_PATHS if p.startswith("/opt/meshllm/models/")}
    assert smollm2_dir.name == MODELS["smollm2"].name and minilm_dir.name == MODELS["minilm"].name


def test_the_gateway_reaches_the_supervisors_engine_and_not_the_supervisor_itself():
    """engine-1 shares the supervisor's sidecar: the gateway's egress names it by authority,
    and the supervisor's sidecar sends that authority (health checks included) to its scheduler."""
    gen = envoy_generator()
    configs = envoy_configs()
    gw = next(lst for lst in configs["gateway"]["static_resources"]["listeners"]
              if lst["address"]["socket_address"]["port_value"] == gen.SUPERVISED_ENGINE_PORT)
    hcm = gw["filter_chains"][0]["filters"][0]["typed_config"]
    authorities = {r["route"]["host_rewrite_literal"] for vh in hcm["route_config"]["virtual_hosts"]
                   for r in vh["routes"]}
    assert len(authorities) == 1
    sup = next(lst for lst in configs["supervisor"]["static_resources"]["listeners"] if lst["name"] == "mesh_ingress")
    vhosts = sup["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"]
    vh = next(v for v in vhosts if v["domains"] == sorted(authorities))
    cluster = vh["routes"][0]["route"]["cluster"]
    ports = {e["endpoint"]["address"]["socket_address"]["port_value"]
             for c in configs["supervisor"]["static_resources"]["clusters"] if c["name"] == cluster
             for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]}
    assert ports == {gen.SUPERVISED_ENGINE_PORT}


def test_tracing_settings_are_valid_and_compose_exports_through_the_sidecar(variant):
    from services.common import telemetry

    gen = envoy_generator()
    _, compose, compose_apps = variant
    for name, (module, _) in compose_apps.items():
        env = {k: str(v) for k, v in compose["services"][name].get("environment", {}).items()}
        cfg = telemetry.config_from_env(module, None, None, env=env)
        host, port = hostport(cfg.endpoint.removeprefix("http://"))
        assert (host, port) == ("127.0.0.1", gen.OTLP_PORT), name
        egress = _egress_map(_sidecar_config(compose, name))
        assert egress[port]["hosts"] == [("otel-collector", gen.OTLP_PORT)], name
    assert "otel-collector" in compose["services"]
    docs = kustomize(K8S_DIR / "overlays" / "cpu")
    data = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("meshllm-config"))
    cfg = telemetry.config_from_env("gateway", None, None, env=data["data"])
    assert cfg.endpoint is None  # off until the operator names a collector


MTLS_OVERLAYS = ("cpu-mtls", "pd-mtls")
TLS_ENV = ("MESHLLM_INTERNAL_TLS_CERTFILE", "MESHLLM_INTERNAL_TLS_KEYFILE", "MESHLLM_INTERNAL_TLS_CA_CERTS")


def tls_identity(workload: dict, module: str) -> str:
    """The identity a container runs with under components/internal-mtls: its service's name, or
    for a prefill/decode engine's scheduler and worker `<role>-<service>` (each role its own)."""
    role = workload["spec"]["template"]["metadata"]["labels"].get("meshllm.io/kv-role")
    return f"{role}-{module}" if role else module


@pytest.fixture(scope="module")
def dev_certs() -> dict[str, dict]:
    """The Secrets deploy/k8s/make-dev-certs.sh writes, by name (the script run once)."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.unit.deploy_tools import kubectl

    r = subprocess.run(["bash", str(K8S_DIR / "make-dev-certs.sh"), "meshllm"], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "PATH": f"{pathlib.Path(kubectl()).parent}:"
                                         f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    made = [d for d in yaml.safe_load_all(r.stdout) if d]
    names = [d["metadata"]["name"] for d in made]
    assert len(names) == len(set(names)), names
    return dict(zip(names, made))


def _dns_names(secret: dict) -> list[str]:
    import base64

    from cryptography import x509
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def test_make_dev_certs_writes_valid_secrets_from_one_ca_each_key_its_certificates(dev_certs):
    import base64

    import kubernetes_validate
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from tests.unit.deploy_tools import K8S_VERSION

    cas = set()
    for name, secret in dev_certs.items():
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        assert secret["metadata"]["namespace"] == "meshllm" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        cas.add(data["ca.crt"])
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(data["ca.crt"]))
        key = serialization.load_pem_private_key(data["tls.key"], None)
        assert key.public_key() == cert.public_key(), name
    assert len(cas) == 1, "the Secrets come from more than one CA: peers would not trust each other"
    # a prefill/decode engine's certificate names its own role's pods and not the other's
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        for module in ("scheduler", "worker"):
            names = _dns_names(dev_certs[f"meshllm-tls-{role}-{module}"])
            assert f"engine-{role}-0.engine-{role}" in names, (role, module, names)
            foreign = [n for n in names if f"engine-{other}" in n or re.match(r"engine-\d+\.engine\b", n)]
            assert not foreign, (role, module, foreign)


@pytest.mark.parametrize("overlay", MTLS_OVERLAYS)
def test_k8s_internal_mtls_gives_each_service_its_identity_and_certs_that_name_what_peers_dial(
        overlay, local_paths, dev_certs):
    """overlays/cpu-mtls and pd-mtls: every container runs with all three internal TLS settings
    (its servers require mTLS and its channels speak it: no internal hop is plain), read from its
    own identity's Secret, which no other container of the pod mounts (a PD engine's scheduler and
    worker: <role>-scheduler and <role>-worker); its probes are exec probes presenting that
    certificate and naming that identity; make-dev-certs.sh makes every one of those Secrets; and
    for every address a service dials (the gateway's and the profiler's engines and services, the
    engines' kvstore), the certificate of the container that answers there names that address."""
    docs, containers = _k8s(overlay, local_paths)
    gen = envoy_generator()
    wanted = {}  # Secret -> identity
    answering = []  # (pod labels, gRPC port, Secret of the container listening there)
    for w, c, module, cfg in containers:
        where = f"{overlay}: {w['metadata']['name']}/{c['name']}"
        pod = w["spec"]["template"]["spec"]
        identity = tls_identity(w, module)
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        paths = [env.get(n) for n in TLS_ENV]
        assert all(paths), f"{where} runs without internal TLS (its servers and channels would be plain)"
        folder, = {p.rsplit("/", 1)[0] for p in paths}
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        volume = mounts[folder]
        assert secrets[volume] == f"meshllm-tls-{identity}", (where, secrets[volume])
        assert [m for m in mounts.values() if m in secrets] == [volume], f"{where} mounts another identity's key"
        shared = [x["name"] for x in pod["containers"] if x is not c
                  and volume in {m["name"] for m in x.get("volumeMounts", [])}]
        assert not shared, f"{where}: its key is mounted into {shared} too"
        wanted[secrets[volume]] = identity
        for name in ("readinessProbe", "livenessProbe", "startupProbe"):
            if name not in c or module == "gateway":  # the gateway's probes ask its public port
                continue
            assert "grpc" not in c[name], f"{where}: a plain grpc {name} against a TLS port"
            cmd = c[name]["exec"]["command"]
            assert "--tls" in cmd, (where, name)
            flags = {f: cmd[cmd.index(f) + 1] for f in ("--tls-certfile", "--tls-keyfile", "--tls-ca-certs",
                                                         "--tls-server-name")}
            assert [flags["--tls-certfile"], flags["--tls-keyfile"], flags["--tls-ca-certs"]] == paths, (where, name)
            assert flags["--tls-server-name"] == identity, (where, name)
        labels = w["spec"]["template"]["metadata"]["labels"]
        answering.append((labels, grpc_port(module, cfg), secrets[volume]))
        if module == "supervisor":  # and its engine-1, whose processes inherit its environment
            answering.append((labels, gen.SUPERVISED_ENGINE_PORT, secrets[volume]))
    missing = set(wanted) - set(dev_certs)
    assert not missing, f"make-dev-certs.sh does not make {sorted(missing)}"
    for secret, identity in wanted.items():  # what the probes' --tls-server-name checks
        assert identity in _dns_names(dev_certs[secret]), (secret, identity)
    reached = set()
    for w, c, module, cfg in containers:
        for addr, identity in outbound(module, cfg):
            if identity in ("worker-zmq", "gateway"):  # pod-local ZMQ; the gateway's public port
                continue
            host, port = hostport(addr)
            svc, _ = _resolve(docs, host)
            behind = {secret for labels, p, secret in answering
                      if p == port and _matches({"matchLabels": svc["spec"]["selector"]}, labels)}
            assert behind, f"{overlay}: {module} dials {addr}, where no container answers"
            for secret in behind:
                assert host in _dns_names(dev_certs[secret]), f"{secret}'s certificate does not name {host}"
            reached |= behind
    # every internal server is dialed by someone and checked (the gateway's ports are public)
    servers = set(wanted) - {"meshllm-tls-gateway"}
    assert reached == servers, sorted(reached ^ servers)
    if overlay == "pd-mtls":
        assert {f"meshllm-tls-{r}-{m}" for r in ("prefill", "decode") for m in ("scheduler", "worker")} <= reached


# ---- prefill/decode ----------------------------------------------------------------------

def test_compose_pd_runs_one_prefill_and_one_decode_engine_on_the_kvstore(local_paths):
    """docker-compose.pd.yml, as each service's own parser reads it: one scheduler per role (the
    hand-off recomputes when KV is missing), every scheduler and worker on the kvstore, each
    scheduler driving its own engine's worker, and the gateway routing to both schedulers."""
    gen = envoy_generator()
    compose = compose_config(*COMPOSE_VARIANTS["pd"])
    apps = _compose_apps(compose, local_paths)
    schedulers = {n: cfg for n, (m, cfg) in apps.items() if m == "scheduler"}
    assert sorted(cfg.kv_role for cfg in schedulers.values()) == ["decode", "prefill"], schedulers
    assert {cfg.kv_load_failure_policy for cfg in schedulers.values()} == {"recompute"}
    for name, (module, cfg) in apps.items():
        if module in ("scheduler", "worker"):
            assert hostport(cfg.kvstore_addr) == ("127.0.0.1", gen.APP_PORTS["kvstore"]), name
    # the engine ids: one per engine (scheduler and the worker its ZMQ reaches), distinct
    ids = {}
    for name, cfg in schedulers.items():
        (worker, _), = _egress_map(_sidecar_config(compose, name))[hostport(cfg.worker_addr)[1]]["hosts"]
        assert apps[worker][1].engine_id == cfg.engine_id, (name, worker)
        ids[cfg.kv_role] = cfg.engine_id
    assert ids["prefill"] != ids["decode"]
    gw_name, (_, gw) = next((n, a) for n, a in apps.items() if a[0] == "gateway")
    egress = _egress_map(_sidecar_config(compose, gw_name))
    reached = [egress[hostport(a)[1]]["hosts"] for a in gw.engine_addrs]
    assert sorted(reached) == sorted([(n, gen.MESH_PORT)] for n in schedulers), reached
    # docker-compose.yml alone stays colocated
    base = _compose_apps(compose_config(*COMPOSE_VARIANTS["base"]), local_paths)
    assert {cfg.kv_role for m, cfg in base.values() if m == "scheduler"} == {""}


@pytest.mark.parametrize("overlay", K8S_PD_OVERLAYS)
def test_k8s_pd_runs_one_prefill_and_one_decode_engine_on_the_kvstore(overlay, local_paths):
    """overlays/pd and pd-mtls, as each service's own parser reads them: the two engine
    StatefulSets have the roles their names and pod labels say, both use the kvstore, and the
    gateway's engine addresses reach exactly their schedulers."""
    docs, containers = _k8s(overlay, local_paths)
    roles = {}
    for w, c, module, cfg in containers:
        if module in ("scheduler", "worker"):
            assert cfg.kvstore_addr, (w["metadata"]["name"], c["name"])
            svc, _ = _resolve(docs, hostport(cfg.kvstore_addr)[0])
            assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "kvstore"}
        if module == "scheduler":
            name = w["metadata"]["name"]
            assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] == 1, name
            assert cfg.kv_load_failure_policy == "recompute", name
            assert w["spec"]["template"]["metadata"]["labels"]["meshllm.io/kv-role"] == cfg.kv_role, name
            roles[name] = cfg.kv_role
    assert roles == {"engine-prefill": "prefill", "engine-decode": "decode"}, roles
    gw = next(cfg for _, _, m, cfg in containers if m == "gateway")
    reached = set()
    for addr in gw.engine_addrs:
        svc, ordinal = _resolve(docs, hostport(addr)[0])
        assert ordinal == 0, addr
        reached |= {w["metadata"]["name"] for w in docs if w["kind"] == "StatefulSet"
                    and all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                            for k, v in svc["spec"]["selector"].items())}
    assert reached == set(roles) and len(gw.engine_addrs) == 2, (gw.engine_addrs, reached)
