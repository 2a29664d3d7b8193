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
    assert "prometheus.yml" in prom_mounts and "mesh-certs" in prom_mounts
    grafana_mounts = " ".join(str(v) for v in s["grafana"]["volumes"])
    assert "provisioning" in grafana_mounts and "dashboards" in grafana_mounts


def test_the_certs_job_makes_every_file_the_sidecars_and_prometheus_read(base, tmp_path):
    """Run the `certs` job's own script here (its image paths mapped to a temporary folder),
    twice: every certificate file an Envoy config or prometheus.yml names exists, each
    identity's certificate names it, and the CA key is kept out of the shared volume."""
    import os
    import subprocess
    import sys

    import yaml
    from cryptography import x509

    from tests.unit.deploy_tools import COMPOSE_DIR, ENVOY_DIR, ROOT

    job = base["services"]["certs"]
    assert job["entrypoint"] == ["sh", "-c"]
    script = job["command"][0].replace("/var/lib/meshllm", str(tmp_path))
    for sub in ("certs", "ca", "public-tls"):
        (tmp_path / sub).mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    for _ in range(2):
        r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr
    assert not (tmp_path / "certs" / "ca.key").exists() and (tmp_path / "ca" / "ca.key").exists()
    mounts = {"/etc/meshllm/certs": tmp_path / "certs", "/etc/meshllm/public-tls": tmp_path / "public-tls"}
    named = []
    for path in [*ENVOY_DIR.glob("*.yaml"), COMPOSE_DIR / "prometheus.yml"]:
        named += re.findall(r"(/etc/meshllm/[a-z-]+)/([\w.-]+)", path.read_text())
    assert len(named) > 20
    for folder, name in set(named):
        assert (mounts[folder] / name).is_file(), f"{folder}/{name} is not made by the certs job"
    for identity in envoy_generator().APP_PORTS:
        cert = x509.load_pem_x509_certificate((tmp_path / "certs" / f"{identity}.pem").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert identity in sans.get_values_for_type(x509.DNSName)
    # the sidecars and Prometheus mount the volume where the configs look for it
    for name, svc in base["services"].items():
        if name.endswith("-envoy") or name == "prometheus":
            targets = {v.split(":")[1] if isinstance(v, str) else v["target"] for v in svc["volumes"]}
            assert "/etc/meshllm/certs" in targets, name
    assert yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"]


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
    for d in dashboards:
        variables = {v["name"]: v for v in json.loads(d.read_text())["templating"]["list"]}
        assert variables["datasource"]["query"] == "prometheus"  # resolves to the provisioned source
