"""deploy/ agrees with the code: every server service is deployed in compose and on
Kubernetes, every deployed command line parses with that service's own argument parser and
config validation, and the ports and addresses line up across the service configs, the
Envoy sidecars, docker-compose and the Kubernetes manifests. A change on either side that
is not made on the other fails here."""
from __future__ import annotations

import importlib
import logging
import pathlib
import re

import pytest

from tests.unit.deploy_tools import (COMPOSE_DIR, K8S_DIR, ROOT, compose_config, envoy_configs, envoy_generator,
                                     kustomize, probe_target)

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
        out += [(addr, re.sub(r"(-\d+)+$", "", name)) for name, addr in cfg.services]
        if cfg.gateway_addr:
            out.append((cfg.gateway_addr, "gateway"))
    return out


# ---- compose -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose():
    return compose_config("docker-compose.yml")


@pytest.fixture(scope="module")
def compose_apps(compose, local_paths):
    """compose service name -> (module, parsed config)."""
    apps = {}
    for name, svc in compose["services"].items():
        if str(svc.get("network_mode", "")).startswith("service:"):
            module, *argv = svc["command"]
            apps[name] = (module, parse_service(module, argv, local_paths))
    return apps


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


def test_every_server_service_is_deployed_in_compose(compose_apps):
    servers = server_services()
    assert {"gateway", "tokenizer", "scheduler", "worker", "embedder"} <= servers
    deployed = {module for module, _ in compose_apps.values()}
    assert servers <= deployed, f"not in docker-compose.yml: {sorted(servers - deployed)}"
    assert deployed <= servers, f"compose runs non-servers: {sorted(deployed - servers)}"


def test_compose_services_listen_where_their_sidecars_forward(compose_apps):
    gen = envoy_generator()
    configs = envoy_configs()
    for name, (module, cfg) in compose_apps.items():
        assert cfg.host == "127.0.0.1", f"{name} listens beyond its sidecar: {cfg.host}"
        assert grpc_port(module, cfg) == gen.APP_PORTS[module], name
        local = _ingress_local_ports(configs[module])
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


def test_compose_services_call_peers_through_sidecar_egress_to_the_right_identity(compose_apps):
    gen = envoy_generator()
    configs = envoy_configs()
    by_host = {name: module for name, (module, _) in compose_apps.items()}
    checked = 0
    for name, (module, cfg) in compose_apps.items():
        egress = _egress_map(configs[module])
        for addr, identity in outbound(module, cfg):
            host, port = hostport(addr)
            assert host == "127.0.0.1", f"{name} calls {addr} directly, not through its sidecar"
            assert port in egress, f"{name} calls {addr}, but its sidecar has no egress there"
            e = egress[port]
            if identity == "worker-zmq":
                assert e["san"] == "worker" and e["hosts"] == [("worker", gen.ZMQ_MESH_PORT)]
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


def test_compose_health_checks_ask_each_service_for_its_readiness(compose, compose_apps):
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

@pytest.fixture(scope="module", params=["cpu", "gpu", "cpu-mtls"])
def k8s(request, local_paths):
    docs = kustomize(K8S_DIR / "overlays" / request.param)
    spec_cm = next(d for d in docs if d["kind"] == "ConfigMap"
                   and d["metadata"]["name"].startswith("meshllm-supervisor-spec"))
    pathlib.Path(local_paths["k8s-spec"]).write_text(spec_cm["data"]["supervisor-spec.json"])
    containers = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                module, *argv = c["args"]
                containers.append((d, c, module, parse_service(module, argv, local_paths)))
    return docs, containers


def test_every_server_service_is_deployed_on_kubernetes(k8s):
    _, containers = k8s
    deployed = {module for _, _, module, _ in containers}
    assert server_services() <= deployed, f"not in deploy/k8s: {sorted(server_services() - deployed)}"


def test_k8s_containers_listen_on_the_same_ports_as_compose_and_probe_them(k8s):
    gen = envoy_generator()
    _, containers = k8s
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
    docs, containers = k8s
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
    docs, containers = k8s
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


def test_k8s_and_compose_run_the_same_services_with_the_same_flags(k8s, compose, compose_apps):
    """Beyond addresses and devices, a service is configured alike in both."""
    _, containers = k8s
    ignore = re.compile(r"^--(host|tokenizer-addr|engine-addr|embedder-addr|profiler-addr|worker|service|"
                        r"gateway-addr|spec|device|kv-cache-memory-gb|engine-id|metrics-port|kvstore-addr)=")
    compose_flags = {}
    for name, svc in compose["services"].items():
        if name in compose_apps:
            module, *argv = svc["command"]
            compose_flags.setdefault(module, {a for a in argv if not ignore.match(a)})
    for w, c, module, _ in containers:
        k8s_flags = {a for a in c["args"][1:] if not ignore.match(a)}
        assert k8s_flags == compose_flags[module], (module, k8s_flags ^ compose_flags[module])


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


def test_tracing_settings_are_valid_and_compose_exports_through_the_sidecar(compose, compose_apps):
    from services.common import telemetry

    gen = envoy_generator()
    configs = envoy_configs()
    for name, (module, _) in compose_apps.items():
        env = {k: str(v) for k, v in compose["services"][name].get("environment", {}).items()}
        cfg = telemetry.config_from_env(module, None, None, env=env)
        host, port = hostport(cfg.endpoint.removeprefix("http://"))
        assert (host, port) == ("127.0.0.1", gen.OTLP_PORT), name
        egress = _egress_map(configs[module])
        assert egress[port]["hosts"] == [("otel-collector", gen.OTLP_PORT)], name
    assert "otel-collector" in compose["services"]
    docs = kustomize(K8S_DIR / "overlays" / "cpu")
    data = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("meshllm-config"))
    cfg = telemetry.config_from_env("gateway", None, None, env=data["data"])
    assert cfg.endpoint is None  # off until the operator names a collector


def test_k8s_internal_mtls_gives_each_service_its_identity_and_certs_that_name_what_peers_dial(local_paths):
    """overlays/cpu-mtls: every container runs with its own identity's Secret, its exec probes
    present that certificate, and make-dev-certs.sh makes exactly those Secrets (valid
    manifests) with certificates whose names cover every address the services dial."""
    import base64
    import os
    import subprocess
    import sys

    import kubernetes_validate
    import yaml
    from cryptography import x509

    from tests.unit.deploy_tools import K8S_VERSION, kubectl

    docs = kustomize(K8S_DIR / "overlays" / "cpu-mtls")
    spec_cm = next(d for d in docs if d["kind"] == "ConfigMap"
                   and d["metadata"]["name"].startswith("meshllm-supervisor-spec"))
    pathlib.Path(local_paths["k8s-spec"]).write_text(spec_cm["data"]["supervisor-spec.json"])
    wanted = {}
    dials = []  # (host, identity that must answer)
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        pod = w["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            module, *argv = c["args"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            cert = env["MESHLLM_INTERNAL_TLS_CERTFILE"]
            secret = secrets[mounts[cert.rsplit("/", 1)[0]]]
            assert secret == f"meshllm-tls-{module}", (module, secret)
            wanted[secret] = module
            for probe in (c["readinessProbe"], c["livenessProbe"]):
                if "exec" in probe:
                    cmd = probe["exec"]["command"]
                    assert cmd[cmd.index("--tls-certfile") + 1] == cert
                    assert cmd[cmd.index("--tls-server-name") + 1] == module
            cfg = parse_service(module, argv, local_paths)
            for addr, identity in outbound(module, cfg):
                host = hostport(addr)[0]
                if identity not in ("worker-zmq", "gateway"):  # pod-local ZMQ; the public port
                    dials.append((host, "supervisor" if host == "supervisor" else identity))
    script = K8S_DIR / "make-dev-certs.sh"
    r = subprocess.run(["bash", str(script), "meshllm"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": f"{pathlib.Path(kubectl()).parent}:"
                            f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    made = {d["metadata"]["name"]: d for d in yaml.safe_load_all(r.stdout) if d}
    assert set(wanted) <= set(made), sorted(set(wanted) - set(made))
    for secret in made.values():
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        assert {"tls.crt", "tls.key", "ca.crt"} <= set(secret["data"])
    assert dials
    for host, identity in dials:
        pem = base64.b64decode(made[f"meshllm-tls-{identity}"]["data"]["tls.crt"])
        names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert host in names, f"{identity}'s certificate does not name {host}"
