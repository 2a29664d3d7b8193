"""deploy/compose: Debian's docker-compose accepts the files (alone, with the GPU override, with
the prefill/decode override), and the mesh has the shape docs/deploy.md promises: one sidecar
per service, only the gateway's sidecar published, a health check on every container; in the
prefill/decode variant one prefill and one decode engine, both on the kvstore, both routed to."""
from __future__ import annotations

import pathlib
import re

import pytest

from tests.unit.deploy_tools import (COMPOSE_DIR, ENVOY_DIR, compose_config, envoy_generator, envoy_pd_generator,
                                     mounted_envoy_config)

BASE = ("docker-compose.yml",)
GPU = ("docker-compose.yml", "docker-compose.gpu.yml")
PD = ("docker-compose.yml", "docker-compose.pd.yml")
PD_GPU = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.pd.yml")
VARIANTS = {"base": BASE, "pd": PD}


@pytest.fixture(scope="module")
def base():
    return compose_config(*BASE)


@pytest.fixture(scope="module")
def gpu():
    return compose_config(*GPU)


@pytest.fixture(scope="module")
def pd():
    return compose_config(*PD)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    """docker-compose.yml alone, and with the prefill/decode override: the checks every mesh passes."""
    return compose_config(*VARIANTS[request.param])


def _started(cfg: dict) -> dict[str, dict]:
    """The services `docker compose up` starts (those without a profile)."""
    return {n: s for n, s in cfg["services"].items() if not s.get("profiles")}


def _apps(cfg: dict) -> dict[str, dict]:
    """meshllm service containers (they run behind a sidecar) that `up` starts."""
    return {n: s for n, s in _started(cfg).items() if str(s.get("network_mode", "")).startswith("service:")}


def _flags(command: list[str]) -> dict[str, list[str]]:
    """--name -> its values, in order (`--name=value` and `--name value` alike)."""
    out: dict[str, list[str]] = {}
    i = 1
    while i < len(command):
        arg = command[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
        elif arg.startswith("--") and i + 1 < len(command) and not command[i + 1].startswith("--"):
            name, value = arg, command[i + 1]
            i += 1
        else:
            name, value = arg, ""
        out.setdefault(name, []).append(value)
        i += 1
    return out


def _one(command: list[str], flag: str) -> str | None:
    values = _flags(command).get(flag, [])
    assert len(values) <= 1, (flag, command)
    return values[0] if values else None


def _port(p) -> tuple[str | None, int]:
    """(host ip or None for all interfaces, container port) of a normalised `ports` entry."""
    if isinstance(p, dict):
        return p.get("host_ip"), int(p["target"])
    parts = str(p).split("/")[0].split(":")  # docker-compose 1.29 keeps "IP:HOST:CONTAINER" as text
    return (parts[0] if len(parts) == 3 else None), int(parts[-1])


def test_docker_compose_accepts_the_files_with_and_without_the_gpu_override(base, gpu):
    assert "gateway" in base["services"] and "worker" in gpu["services"]


def test_docker_compose_accepts_the_pd_override_alone_and_after_the_gpu_one(pd):
    assert {"decode-scheduler", "decode-worker", "kvstore"} <= set(_started(pd))
    pd_gpu = compose_config(*PD_GPU)
    assert set(pd_gpu["services"]) == set(pd["services"])
    # the PD override leaves the GPU override's worker (the prefill one) alone
    assert "--device=cuda" in pd_gpu["services"]["worker"]["command"]
    assert pd_gpu["services"]["worker"]["deploy"] == compose_config(*GPU)["services"]["worker"]["deploy"]


def test_the_gpu_override_reserves_a_gpu_for_the_worker_only(base, gpu):
    devices = gpu["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "--device=cuda" in gpu["services"]["worker"]["command"]
    assert "--device=cpu" in base["services"]["worker"]["command"]
    assert "deploy" not in base["services"]["worker"]
    others = [n for n, s in gpu["services"].items() if n != "worker" and "deploy" in s]
    assert others == []


def test_every_container_has_a_health_check(base, gpu, pd):
    for cfg in (base, gpu, pd):
        for name, svc in cfg["services"].items():
            assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_each_service_runs_in_the_network_namespace_of_its_own_envoy_sidecar(base):
    gen = envoy_generator()
    identities = {s.identity for s in gen.SIDECARS}
    for name, svc in _apps(base).items():
        sidecar_name = svc["network_mode"].removeprefix("service:")
        assert sidecar_name == f"{name}-envoy"
        sidecar = base["services"][sidecar_name]
        identity = svc["command"][0]
        assert identity in identities, f"{name} runs {identity!r}, which has no Envoy config"
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in sidecar["volumes"]]
        assert any(m.endswith(f"envoy/{identity}.yaml:/etc/envoy/envoy.yaml:ro") or
                   f"envoy/{identity}.yaml:/etc/envoy/envoy.yaml" in m for m in mounts), (name, mounts)
        assert sidecar["image"].startswith("envoyproxy/envoy:")
        aliases = sidecar["networks"]["mesh"]["aliases"]
        assert aliases == [name], (name, aliases)
        assert name in gen.HOSTS.get(identity, (identity,)), f"{name} is not a host Envoy routes to"
    # every sidecar config is used, and every host the sidecars route to exists
    used = {svc["command"][0] for svc in _apps(base).values()}
    assert used == identities
    for identity, hosts in gen.HOSTS.items():
        for host in hosts:
            assert host in _apps(base), f"Envoy routes {identity} to {host}, which compose lacks"


def test_only_the_gateway_sidecar_is_published_and_the_uis_only_on_loopback(variant):
    gen = envoy_generator()
    published = {}
    for name, svc in variant["services"].items():
        for port in svc.get("ports", []):
            published.setdefault(name, []).append(port)
    gateway = published.pop("gateway-envoy")
    assert [_port(p) for p in gateway] == [(None, gen.PUBLIC_PORT)]
    assert set(published) == {"jaeger", "prometheus", "grafana"}
    for name, ports in published.items():
        assert all(_port(p)[0] == "127.0.0.1" for p in ports), (name, ports)


def test_the_observability_stack_is_wired(variant):
    s = variant["services"]
    assert {"otel-collector", "jaeger", "prometheus", "grafana"} <= set(_started(variant))
    for name, svc in _apps(variant).items():
        env = svc.get("environment", {})
        assert env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "http://127.0.0.1:4317", name
    prom_mounts = " ".join(str(v) for v in s["prometheus"]["volumes"])
    assert "prometheus.yml" in prom_mounts and "certs-prometheus:/etc/meshllm/certs" in prom_mounts
    grafana_mounts = " ".join(str(v) for v in s["grafana"]["volumes"])
    assert "provisioning" in grafana_mounts and "dashboards" in grafana_mounts


def _volume_mounts(svc: dict) -> dict[str, str]:
    """container path -> named volume (or host path) of a normalised service."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out[target] = source
    return out


def test_the_certs_job_gives_each_sidecar_its_own_key_and_every_file_it_reads(base, pd, tmp_path):
    """Run the `certs` job's script here (its volumes mapped to folders), twice and after losing
    one identity's volume: every certificate file an Envoy config or prometheus.yml names (the
    one the container really mounts, in docker-compose.yml and with the prefill/decode override)
    is in the volume that container mounts, each certificate names its identity, no volume holds
    another identity's key or the CA key, and a reissued certificate comes from the same CA."""
    import os
    import subprocess
    import sys

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.unit.deploy_tools import ROOT

    job = base["services"]["certs"]
    # the PD override needs no identity of its own (merged files list the volumes in another order)
    assert {k: v for k, v in pd["services"]["certs"].items() if k != "volumes"} == \
        {k: v for k, v in job.items() if k != "volumes"}
    assert _volume_mounts(pd["services"]["certs"]) == _volume_mounts(job)
    job_mounts = _volume_mounts(job)
    script = pathlib.Path(job_mounts["/usr/local/bin/meshllm-certs"])
    assert script == COMPOSE_DIR / "certs.sh"
    out = tmp_path / "out"
    env = {**os.environ, "MESHLLM_CERTS_OUT": str(out), "PYTHONPATH": str(ROOT),
           "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}

    def run():
        r = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr

    run()
    run()
    volume_dir = {source: out / target.removeprefix(job["environment"]["MESHLLM_CERTS_OUT"] + "/")
                  for target, source in job_mounts.items() if target.startswith("/out/")}
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.pem").read_bytes())
    readers = [(variant, name, svc) for variant, cfg in (("base", base), ("pd", pd))
               for name, svc in cfg["services"].items() if name.endswith("-envoy") or name == "prometheus"]
    assert any(name == "decode-scheduler-envoy" for _, name, _ in readers)
    for variant, name, svc in readers:
        mounts = _volume_mounts(svc)
        certs = volume_dir[mounts["/etc/meshllm/certs"]]
        identity = certs.name
        config = pathlib.Path(mounts["/etc/prometheus/prometheus.yml" if name == "prometheus" else "/etc/envoy/envoy.yaml"])
        if variant == "base":
            assert config == (ENVOY_DIR / f"{identity}.yaml" if name != "prometheus" else COMPOSE_DIR / "prometheus.yml")
        for folder, file in set(re.findall(r"(/etc/meshllm/[a-z-]+)/([\w.-]+)", config.read_text())):
            where = certs if folder == "/etc/meshllm/certs" else volume_dir[mounts[folder]]
            assert (where / file).is_file(), f"{variant}: {name}: {folder}/{file} is not in {where}"
        keys = sorted(p.name for p in certs.glob("*.key"))
        assert keys == [f"{identity}.key"], (name, keys)
        cert = x509.load_pem_x509_certificate((certs / f"{identity}.pem").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert identity in sans.get_values_for_type(x509.DNSName)
        assert cert.issuer == ca.subject
    # a lost identity volume is reissued by the same CA, the others are left alone
    before = (out / "gateway" / "gateway.pem").read_bytes()
    for f in (out / "worker").iterdir():
        f.unlink()
    run()
    worker = x509.load_pem_x509_certificate((out / "worker" / "worker.pem").read_bytes())
    ca.public_key().verify(worker.signature, worker.tbs_certificate_bytes,
                           ec.ECDSA(worker.signature_hash_algorithm))  # raises if another CA signed it
    assert (out / "gateway" / "gateway.pem").read_bytes() == before


def test_collector_grafana_and_prometheus_configs_point_at_the_compose_services(base):
    """The observability configs name services, ports and paths compose really has."""
    import json

    import yaml

    from tests.unit.deploy_tools import DEPLOY

    services = base["services"]
    col = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    for name, pipe in col["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipe[kind]) <= set(col[kind]), (name, kind)
    assert col["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(f":{envoy_generator().OTLP_PORT}")
    host = col["exporters"]["otlp/jaeger"]["endpoint"].split(":")[0]
    assert host in services
    sources = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/datasources/meshllm.yaml").read_text())
    by_type = {d["type"]: d for d in sources["datasources"]}
    assert by_type["prometheus"]["url"] == "http://prometheus:9090" and by_type["prometheus"]["isDefault"]
    assert by_type["jaeger"]["url"].split("//")[1].split(":")[0] in services
    provider = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/dashboards/meshllm.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"] if isinstance(v, str)}
    assert pathlib.Path(mounts[path]) == DEPLOY / "grafana" / "dashboards"
    dashboards = list((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    provisioned = {d["uid"] for d in sources["datasources"]}
    for d in dashboards:  # every panel's data source is a provisioned one, or a variable over them
        board = json.loads(d.read_text())
        variables = {v["name"]: v for v in board.get("templating", {}).get("list", [])}
        uids = set(re.findall(r'"datasource":\s*\{[^}]*"uid":\s*"([^"]+)"', d.read_text()))
        assert uids, d.name
        for uid in uids:
            if uid.startswith("${"):
                var = variables[uid[2:-1]]
                assert var["type"] == "datasource" and var["query"] in by_type, (d.name, uid)
            else:
                assert uid in provisioned, (d.name, uid)


def test_prometheus_scrapes_every_started_sidecar_and_nothing_else(variant):
    """The prometheus.yml Prometheus mounts targets exactly the sidecars `up` starts (their mesh
    port), the service's /metrics and the sidecar's stats alike; with the PD override both
    engines' and not the parked supervisor's."""
    import yaml

    gen = envoy_generator()
    mounts = _volume_mounts(variant["services"]["prometheus"])
    prom = yaml.safe_load(pathlib.Path(mounts["/etc/prometheus/prometheus.yml"]).read_text())
    sidecars = {alias: name.removesuffix("-envoy") for name, svc in _started(variant).items()
                if name.endswith("-envoy") for alias in svc["networks"]["mesh"]["aliases"]}
    scraped: dict[str, set[str]] = {}
    for job in prom["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                if job["job_name"] == "prometheus":
                    continue
                assert host in sidecars and int(port) == gen.MESH_PORT, (job["job_name"], target)
                scraped.setdefault(host, set()).add(job["metrics_path"])
    assert set(scraped) == set(sidecars), set(sidecars) ^ set(scraped)
    for host, paths in scraped.items():
        assert {"/metrics", "/stats/prometheus"} <= paths, (host, paths)


# ---- prefill/decode (docker-compose.pd.yml) -------------------------------------------------

def _schedulers(cfg: dict) -> dict[str, list[str]]:
    return {n: s["command"] for n, s in _apps(cfg).items() if s["command"][0] == "scheduler"}


def test_pd_has_exactly_one_prefill_and_one_decode_scheduler(pd):
    roles = {name: _one(cmd, "--kv-role") for name, cmd in _schedulers(pd).items()}
    assert sorted(roles.values()) == ["decode", "prefill"], roles
    assert roles == {sched: role for role, (sched, _) in envoy_pd_generator().ENGINES.items()}
    for name, cmd in _schedulers(pd).items():
        assert _one(cmd, "--kv-load-failure-policy") == "recompute", name
    # docker-compose.yml alone stays colocated
    assert all(_one(cmd, "--kv-role") is None for cmd in _schedulers(compose_config(*BASE)).values())


def test_every_pd_scheduler_and_worker_reaches_the_kvstore_through_its_sidecar(pd):
    gen = envoy_generator()
    kv_port = gen.APP_PORTS["kvstore"]
    engines = {n: s for n, s in _apps(pd).items() if s["command"][0] in ("scheduler", "worker")}
    assert len(engines) == 4, sorted(engines)
    assert "kvstore" in _apps(pd)
    for name, svc in engines.items():
        assert _one(svc["command"], "--kvstore-addr") == f"127.0.0.1:{kv_port}", name
        _, boot = mounted_envoy_config(pd, f"{name}-envoy")
        egress = {lst["address"]["socket_address"]["port_value"]: lst for lst in boot["static_resources"]["listeners"]
                  if lst["address"]["socket_address"]["address"] == "127.0.0.1"}
        assert kv_port in egress, f"{name}'s sidecar has no kvstore egress"
        cluster = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "kvstore_mesh")
        hosts = [e["endpoint"]["address"]["socket_address"]["address"]
                 for g in cluster["load_assignment"]["endpoints"] for e in g["lb_endpoints"]]
        assert hosts == ["kvstore"], (name, hosts)


def _egress_hosts(boot: dict) -> dict[int, list[str]]:
    """Loopback port of a sidecar -> the hosts its cluster sends to."""
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    out = {}
    for lst in boot["static_resources"]["listeners"]:
        sa = lst["address"]["socket_address"]
        if sa["address"] != "127.0.0.1":
            continue
        f = lst["filter_chains"][0]["filters"][0]["typed_config"]
        name = f.get("cluster") or f["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["cluster"]
        out[sa["port_value"]] = [e["endpoint"]["address"]["socket_address"]["address"]
                                 for g in clusters[name]["load_assignment"]["endpoints"] for e in g["lb_endpoints"]]
    return out


def test_the_pd_gateway_lists_both_schedulers_each_through_its_own_egress(pd):
    gw = _apps(pd)["gateway"]["command"]
    addrs = _flags(gw)["--engine-addr"]
    assert len(addrs) == len(set(addrs)) == 2, addrs
    _, boot = mounted_envoy_config(pd, "gateway-envoy")
    egress = _egress_hosts(boot)
    reached = []
    for addr in addrs:
        host, port = addr.rsplit(":", 1)
        assert host == "127.0.0.1", addr
        reached.append(egress[int(port)])
    assert sorted(reached) == sorted([s] for s in _schedulers(pd)), reached  # one scheduler per address


def test_each_pd_service_runs_behind_its_own_sidecar_with_the_generator_s_config(pd):
    pdgen = envoy_pd_generator()
    apps = _apps(pd)
    assert set(apps) == set(pdgen.CONFIG_FILES), set(apps) ^ set(pdgen.CONFIG_FILES)
    for name, svc in apps.items():
        identity = svc["command"][0]
        sidecar_name = svc["network_mode"].removeprefix("service:")
        assert sidecar_name == f"{name}-envoy"
        sidecar = pd["services"][sidecar_name]
        assert not sidecar.get("profiles")
        assert sidecar["networks"]["mesh"]["aliases"] == [name]
        assert name in pdgen.HOSTS.get(identity, (identity,)), f"{name} is not a host Envoy routes {identity} to"
        path, _ = mounted_envoy_config(pd, sidecar_name)
        assert path == ENVOY_DIR / pdgen.CONFIG_FILES[name], (name, path)
        assert _volume_mounts(sidecar)["/etc/meshllm/certs"] == f"certs-{identity}", name
        assert sidecar["image"].startswith("envoyproxy/envoy:")


def test_the_decode_engine_is_the_prefill_engine_in_another_role(pd):
    """Only the role, the engine id and the sidecar's wiring tell the two engines' containers
    apart (so a change to engine 0 in docker-compose.yml that the decode engine misses fails)."""
    import copy

    engines = envoy_pd_generator().ENGINES
    services = pd["services"]

    def strip(svc: dict, me: str, volume_target: str | None = None) -> dict:
        svc = copy.deepcopy(svc)
        if "command" in svc and svc["command"][0] in ("scheduler", "worker"):
            svc["command"] = [a for a in svc["command"] if not a.startswith(("--engine-id=", "--kv-role="))]
        if volume_target:
            svc["volumes"] = [v for v in svc["volumes"] if f":{volume_target}" not in str(v)]
            svc["networks"]["mesh"]["aliases"] = [a.replace(me, "ME") for a in svc["networks"]["mesh"]["aliases"]]
        if "network_mode" in svc:
            svc["network_mode"] = svc["network_mode"].replace(me, "ME")
            svc["depends_on"] = {k.replace(me, "ME"): v for k, v in svc["depends_on"].items()} \
                if isinstance(svc["depends_on"], dict) else [d.replace(me, "ME") for d in svc["depends_on"]]
        return svc

    ids = {}
    for prefill, decode in zip(engines["prefill"], engines["decode"]):
        assert strip(services[decode], decode) == strip(services[prefill], prefill), (prefill, decode)
        assert strip(services[f"{decode}-envoy"], decode, "/etc/envoy/envoy.yaml") == \
            strip(services[f"{prefill}-envoy"], prefill, "/etc/envoy/envoy.yaml"), (prefill, decode)
    for role, hosts in engines.items():  # one engine id per engine, a different one per engine
        ids[role] = {_one(services[h]["command"], "--engine-id") for h in hosts}
        assert len(ids[role]) == 1 and None not in ids[role], (role, ids[role])
    assert ids["prefill"] != ids["decode"]


def test_the_pd_override_parks_the_supervisor_and_its_colocated_engine(pd):
    parked = {n for n, s in pd["services"].items() if s.get("profiles")}
    assert parked == {"supervisor", "supervisor-envoy"}
    assert all(pd["services"][n]["profiles"] == ["colocated"] for n in parked)
    for name, svc in _started(pd).items():
        deps = svc.get("depends_on", {})
        assert not parked & set(deps), f"{name} depends on a service the PD variant does not start"
        assert str(svc.get("network_mode", "")).removeprefix("service:") not in parked, name
    # the same anchors as docker-compose.yml: image, restart, environment and sidecar settings
    base = compose_config(*BASE)["services"]
    for decode, prefill in (("decode-scheduler", "scheduler"), ("decode-worker", "worker")):
        for key in ("image", "restart", "environment", "stop_grace_period"):
            assert pd["services"][decode].get(key) == base[prefill].get(key), (decode, key)
        for key in ("image", "restart", "environment", "healthcheck", "command", "depends_on"):
            assert pd["services"][f"{decode}-envoy"].get(key) == base[f"{prefill}-envoy"].get(key), (decode, key)
    assert (COMPOSE_DIR / "docker-compose.pd.yml").read_text().lstrip().startswith("#")
