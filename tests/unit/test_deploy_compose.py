"""deploy/compose: Debian's docker-compose accepts the files (alone and with the GPU
override), and the mesh has the shape docs/deploy.md promises: one sidecar per service, only
the gateway's sidecar published, a health check on every container."""
from __future__ import annotations

import pathlib
import re

import pytest

from tests.unit.deploy_tools import compose_config, envoy_generator

BASE = ("docker-compose.yml",)
GPU = ("docker-compose.yml", "docker-compose.gpu.yml")


@pytest.fixture(scope="module")
def base():
    return compose_config(*BASE)


@pytest.fixture(scope="module")
def gpu():
    return compose_config(*GPU)


def _apps(cfg: dict) -> dict[str, dict]:
    """meshllm service containers (they run behind a sidecar)."""
    return {n: s for n, s in cfg["services"].items() if str(s.get("network_mode", "")).startswith("service:")}


def _port(p) -> tuple[str | None, int]:
    """(host ip or None for all interfaces, container port) of a normalised `ports` entry."""
    if isinstance(p, dict):
        return p.get("host_ip"), int(p["target"])
    parts = str(p).split("/")[0].split(":")  # docker-compose 1.29 keeps "IP:HOST:CONTAINER" as text
    return (parts[0] if len(parts) == 3 else None), int(parts[-1])


def test_docker_compose_accepts_the_files_with_and_without_the_gpu_override(base, gpu):
    assert "gateway" in base["services"] and "worker" in gpu["services"]


def test_the_gpu_override_reserves_a_gpu_for_the_worker_only(base, gpu):
    devices = gpu["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "--device=cuda" in gpu["services"]["worker"]["command"]
    assert "--device=cpu" in base["services"]["worker"]["command"]
    assert "deploy" not in base["services"]["worker"]
    others = [n for n, s in gpu["services"].items() if n != "worker" and "deploy" in s]
    assert others == []


def test_every_container_has_a_health_check(base, gpu):
    for cfg in (base, gpu):
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


def test_only_the_gateway_sidecar_is_published_and_the_uis_only_on_loopback(base):
    gen = envoy_generator()
    published = {}
    for name, svc in base["services"].items():
        for port in svc.get("ports", []):
            published.setdefault(name, []).append(port)
    gateway = published.pop("gateway-envoy")
    assert [_port(p) for p in gateway] == [(None, gen.PUBLIC_PORT)]
    assert set(published) == {"jaeger", "prometheus", "grafana"}
    for name, ports in published.items():
        assert all(_port(p)[0] == "127.0.0.1" for p in ports), (name, ports)


def test_the_observability_stack_is_wired(base):
    s = base["services"]
    assert {"otel-collector", "jaeger", "prometheus", "grafana"} <= set(s)
    for name, svc in _apps(base).items():
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


def test_the_certs_job_gives_each_sidecar_its_own_key_and_every_file_it_reads(base, tmp_path):
    """Run the `certs` job's script here (its volumes mapped to folders), twice and after losing
    one identity's volume: every certificate file an Envoy config or prometheus.yml names is in
    the volume that container mounts, each certificate names its identity, no volume holds
    another identity's key or the CA key, and a reissued certificate comes from the same CA."""
    import os
    import subprocess
    import sys

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.unit.deploy_tools import COMPOSE_DIR, ENVOY_DIR, ROOT

    job = base["services"]["certs"]
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
    readers = {name: svc for name, svc in base["services"].items() if name.endswith("-envoy") or name == "prometheus"}
    for name, svc in readers.items():
        mounts = _volume_mounts(svc)
        certs = volume_dir[mounts["/etc/meshllm/certs"]]
        identity = certs.name
        config = ENVOY_DIR / f"{identity}.yaml" if name != "prometheus" else COMPOSE_DIR / "prometheus.yml"
        for folder, file in set(re.findall(r"(/etc/meshllm/[a-z-]+)/([\w.-]+)", config.read_text())):
            where = certs if folder == "/etc/meshllm/certs" else volume_dir[mounts[folder]]
            assert (where / file).is_file(), f"{name}: {folder}/{file} is not in {where}"
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

    from tests.unit.deploy_tools import COMPOSE_DIR, DEPLOY

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
