"""What the deploy/ tests need from outside the venv, installed on first use, and the loaders
they share (compose, Envoy, Kubernetes). A tool that cannot be had fails the test: these
checks are the only ones deploy/ gets, since no container engine runs here.

- docker-compose: Debian's package (`apt-get install docker-compose`, about 16 s measured
  here with `apt-get update`), installed when missing and running as root (CI is);
  otherwise the test fails and says how to install it.
- xds-protos (Envoy's v3 API as Python descriptors): pinned in requirements-deploy-test.txt,
  installed with `pip --target` into its own folder (about 2 s): it ships its own
  `opentelemetry.proto` and `google.*` modules, which must not overwrite the venv's.
- kubectl (its built-in kustomize renders deploy/k8s): on this machine image already.
- kubernetes-validate (the Kubernetes JSON schemas): requirements-test.txt, in the venv.
"""
from __future__ import annotations

import functools
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
ENVOY_DIR = COMPOSE_DIR / "envoy"
PD_ENVOY_DIR = ENVOY_DIR / "pd"  # the sidecar configs only docker-compose.pd.yml uses
K8S_DIR = DEPLOY / "k8s"
XDS_REQUIREMENTS = ROOT / "requirements-deploy-test.txt"
K8S_VERSION = "1.37.0"  # the Kubernetes release whose schemas the manifests must satisfy


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def docker_compose() -> str:
    """Path of docker-compose, installing Debian's package when missing (root only)."""
    found = shutil.which("docker-compose")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("docker-compose is not installed and this is not root: "
                    "run `sudo apt-get install -y docker-compose`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "docker-compose"]):
        r = _run(cmd, timeout=600, env=env)
        if r.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr[-2000:]}")
    found = shutil.which("docker-compose")
    if not found:
        pytest.fail("apt-get installed docker-compose but it is not on PATH")
    return found


def _xds_pin() -> str:
    for line in XDS_REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("xds-protos=="):
            return line
    raise AssertionError(f"{XDS_REQUIREMENTS} pins no xds-protos version")


def xds_protos_dir() -> pathlib.Path:
    """A folder holding exactly the pinned xds-protos (for PYTHONPATH), installed if missing."""
    pin = _xds_pin()
    base = ROOT / ".venv" if (ROOT / ".venv").is_dir() else pathlib.Path.home() / ".cache" / "meshllm"
    target = base / "deploy-tools" / pin.replace("==", "-")
    marker = target / ".installed"
    if not marker.exists():
        shutil.rmtree(target, ignore_errors=True)
        r = _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                  "--target", str(target), pin], timeout=600)
        if r.returncode != 0:
            pytest.fail(f"pip could not install {pin}: {r.stderr[-2000:]}")
        marker.write_text(pin + "\n")
    return target


def kubectl() -> str:
    found = shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl (for `kubectl kustomize`) is not installed; it comes with this machine "
                    "image: install kubectl >= 1.27 to render deploy/k8s")
    return found


@functools.lru_cache(maxsize=None)
def _kustomize_text(overlay: pathlib.Path) -> str:
    r = _run([kubectl(), "kustomize", str(overlay)], timeout=120)
    assert r.returncode == 0, f"kustomize {overlay} failed: {r.stderr}"
    return r.stdout


def kustomize(overlay: pathlib.Path) -> list[dict]:
    """The rendered documents of a kustomization (real kustomize, built into kubectl); rendered
    once per test session, parsed afresh for each caller."""
    return [d for d in yaml.safe_load_all(_kustomize_text(overlay)) if d]


@functools.lru_cache(maxsize=None)
def _compose_text(files: tuple[str, ...]) -> str:
    cmd = [docker_compose()]
    for f in files:
        cmd += ["-f", str(COMPOSE_DIR / f)]
    r = _run([*cmd, "config"], timeout=120, cwd=COMPOSE_DIR)
    assert r.returncode == 0, f"docker-compose config {files} failed:\n{r.stderr}"
    return r.stdout


def compose_config(*files: str) -> dict:
    """`docker-compose config` of the given files (relative to deploy/compose), parsed (run
    once per test session)."""
    return yaml.safe_load(_compose_text(tuple(files)))


def envoy_configs() -> dict[str, dict]:
    """identity -> its sidecar's bootstrap (as YAML data)."""
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(ENVOY_DIR.glob("*.yaml"))}


def all_envoy_configs() -> dict[str, dict]:
    """Every committed sidecar bootstrap, keyed by its path under deploy/compose/envoy
    ("gateway.yaml", "pd/gateway.yaml", ...): what the per-config checks run over."""
    paths = [*sorted(ENVOY_DIR.glob("*.yaml")), *sorted(PD_ENVOY_DIR.glob("*.yaml"))]
    return {str(p.relative_to(ENVOY_DIR)): yaml.safe_load(p.read_text()) for p in paths}


def _load_module(name: str, path: pathlib.Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def envoy_generator():
    """deploy/compose/envoy/generate.py as a module (the topology the configs are built from)."""
    return _load_module("meshllm_envoy_generate", ENVOY_DIR / "generate.py")


def envoy_pd_generator():
    """deploy/compose/envoy/pd/generate.py as a module: the prefill/decode variant's topology
    (HOSTS, ENGINES, CONFIG_FILES: which file each compose host's sidecar mounts)."""
    return _load_module("meshllm_envoy_generate_pd", PD_ENVOY_DIR / "generate.py")


def mounted_envoy_config(cfg: dict, sidecar: str) -> tuple[pathlib.Path, dict]:
    """(file, bootstrap) of the Envoy config that compose service `sidecar` (a normalised
    `docker-compose config`) mounts at /etc/envoy/envoy.yaml: the file that would really run."""
    for v in cfg["services"][sidecar].get("volumes", []):
        source, target = (v.split(":")[:2] if isinstance(v, str) else (v["source"], v["target"]))
        if target == "/etc/envoy/envoy.yaml":
            path = pathlib.Path(source)
            path = path if path.is_absolute() else COMPOSE_DIR / path
            return path, yaml.safe_load(path.read_text())
    raise AssertionError(f"{sidecar} mounts no /etc/envoy/envoy.yaml")


def probe_target(probe: dict) -> tuple[int, str]:
    """(port, grpc.health.v1 service) a probe asks: a native grpc probe, or an exec probe
    running `meshllm health` (parsed by the command's own parser)."""
    if "grpc" in probe:
        assert "exec" not in probe
        return probe["grpc"]["port"], probe["grpc"].get("service", "")
    cmd = probe["exec"]["command"]
    assert cmd[:2] == ["meshllm", "health"], cmd
    from services.cli.health import parse_args
    cfg = parse_args(cmd[2:])  # the command's own parser and validation
    return int(cfg.addr.rsplit(":", 1)[1]), cfg.service
