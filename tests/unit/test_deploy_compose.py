"""deploy/compose: Debian's docker-compose accepts the files (alone and with the GPU
override), and the mesh has the shape docs/deploy.md promises: one sidecar per service, only
the gateway's sidecar published, a health check on every container."""
from __future__ import annotations

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
