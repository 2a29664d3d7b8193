"""Write the Envoy sidecar configs that the prefill/decode compose variant
(deploy/compose/docker-compose.pd.yml, docs/pd.md) adds, and its prometheus.yml.

    python deploy/compose/envoy/pd/generate.py     # rewrites deploy/compose/envoy/pd/*.yaml + prometheus.yml

Everything is built by ../generate.py's own code (the same listeners, clusters, limits, retries
and mTLS as every other sidecar); only the topology differs from docker-compose.yml's:

  prefill engine   `scheduler` + `worker` (docker-compose.yml's engine 0, with --kv-role=prefill):
                   their sidecars keep ../scheduler.yaml and ../worker.yaml
  decode engine    `decode-scheduler`: decode-scheduler.yaml, the scheduler's sidecar with its ZMQ
                   egress to `decode-worker`;
                   `decode-worker`: ../worker.yaml (a worker's sidecar names no host of its engine)
  gateway          gateway.yaml: one egress per engine, each to that one scheduler (the gateway
                   must see two engines, not one balanced pair): 127.0.0.1:50053 is the prefill
                   engine, 127.0.0.1:50153 the decode engine; no supervised engine-1
  profiler         profiler.yaml: one egress per replica, both engines' schedulers and workers
                   included (host i of an identity at its port + 100 * i, as in ../generate.py)
  prometheus.yml   scrapes both engines; the supervisor is not started in this variant

The certificate identities are docker-compose.yml's: both engines' sidecars present the
`scheduler` / `worker` certificates (volumes certs-scheduler / certs-worker), as the two
tokenizers share `tokenizer`; every peer checks the identity, and the kvstore, tokenizer and
worker RBAC already admit them. tests/unit/test_deploy_envoy.py fails when the files here differ
from what this script writes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import yaml

HERE = pathlib.Path(__file__).resolve().parent
ENVOY_DIR = HERE.parent


def _load_base():
    """A private copy of ../generate.py: this module points its HOSTS and SIDECARS at the PD
    topology (so its egress_each and prometheus_config see it) without touching anyone else's."""
    spec = importlib.util.spec_from_file_location("meshllm_envoy_generate_for_pd", ENVOY_DIR / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


base = _load_base()
COLOCATED_SIDECARS = base.SIDECARS
Egress, Sidecar = base.Egress, base.Sidecar
MESH_PORT, ZMQ_MESH_PORT, APP_PORTS = base.MESH_PORT, base.ZMQ_MESH_PORT, base.APP_PORTS

# role -> (scheduler host, worker host): the compose services of each engine.
ENGINES = {"prefill": ("scheduler", "worker"), "decode": ("decode-scheduler", "decode-worker")}
# Compose hosts (network aliases of the sidecars) behind each identity, in egress order
# (host i listens on the identity's port + 100 * i in the gateway's and the profiler's namespaces).
HOSTS = {**base.HOSTS,
         "scheduler": tuple(s for s, _ in ENGINES.values()),
         "worker": tuple(w for _, w in ENGINES.values())}
# Not started in this variant (docker-compose.pd.yml parks it behind a profile): the gateway
# routes to the two engines only.
PARKED = ("supervisor",)
base.HOSTS = HOSTS


def _colocated(identity: str) -> Sidecar:
    return next(s for s in COLOCATED_SIDECARS if s.identity == identity)


def _gateway() -> Sidecar:
    """The gateway's sidecar with one egress per engine instead of docker-compose.yml's engine 0
    + the supervisor's engine-1."""
    gw = _colocated("gateway")
    egress = []
    for e in gw.egress:
        if e.identity in PARKED:
            continue
        egress += base.egress_each("scheduler") if e.identity == "scheduler" else [e]
    return dataclasses.replace(gw, egress=tuple(egress))


def _profiler() -> Sidecar:
    """The profiler's sidecar, every replica of every identity it reaches (both engines)."""
    prof = _colocated("profiler")
    peers = dict.fromkeys(e.identity for e in prof.egress)
    return dataclasses.replace(prof, egress=tuple(x for p in peers for x in base.egress_each(p)))


# Every identity's sidecar in this variant (what prometheus.yml scrapes).
SIDECARS = tuple({"gateway": _gateway, "profiler": _profiler}.get(s.identity, lambda s=s: s)()
                 for s in COLOCATED_SIDECARS if s.identity not in PARKED)
base.SIDECARS = SIDECARS


def _decode_scheduler() -> dict:
    """The scheduler's sidecar whose ZMQ egress (TLS-wrapped TCP) goes to the decode worker."""
    boot = base.build(_colocated("scheduler"))
    prefill_worker, decode_worker = ENGINES["prefill"][1], ENGINES["decode"][1]
    replaced = 0
    for c in boot["static_resources"]["clusters"]:
        if c["name"] != "worker_zmq":
            continue
        for group in c["load_assignment"]["endpoints"]:
            for ep in group["lb_endpoints"]:
                sa = ep["endpoint"]["address"]["socket_address"]
                assert (sa["address"], sa["port_value"]) == (prefill_worker, ZMQ_MESH_PORT), sa
                sa["address"] = decode_worker
                replaced += 1
    assert replaced == 1, f"the scheduler's sidecar has {replaced} ZMQ endpoints, expected 1"
    return boot


# The file of each compose host's sidecar, relative to deploy/compose/envoy/ (the tests check
# that docker-compose.pd.yml mounts exactly these). A worker's sidecar names no host of its
# engine (ZMQ ingress from any `scheduler` identity, egress to the kvstore), so the decode
# worker's is ../worker.yaml.
assert not _colocated("worker").zmq_to_worker and not _colocated("worker").local_hosts
CONFIG_FILES = {
    **{host: f"{s.identity}.yaml" for s in SIDECARS for host in HOSTS.get(s.identity, (s.identity,))},
    "gateway": "pd/gateway.yaml",
    "profiler": "pd/profiler.yaml",
    ENGINES["decode"][0]: "pd/decode-scheduler.yaml",
}
PROMETHEUS_PATH = HERE / "prometheus.yml"

HEADER = ("# Generated by deploy/compose/envoy/pd/generate.py; do not edit (edit the script and rerun it).\n"
          "# Envoy v3 static bootstrap of the {name} sidecar of docker-compose.pd.yml (prefill/decode).\n")
BASE_PROM_HEADER = "# Generated by deploy/compose/envoy/generate.py; do not edit.\n"
PROM_HEADER = ("# Generated by deploy/compose/envoy/pd/generate.py; do not edit.\n"
               "# The prometheus.yml of docker-compose.pd.yml (prefill/decode: both engines, no supervisor).\n")


def _dump(boot: dict) -> str:
    return yaml.dump(boot, Dumper=base._Dumper, sort_keys=False, width=200)


def render_all() -> dict[str, str]:
    """File name (in this folder) -> text, for the sidecar configs only this variant has."""
    boots = {"gateway": base.build(_gateway()), "profiler": base.build(_profiler()),
             ENGINES["decode"][0]: _decode_scheduler()}
    return {f"{host}.yaml": HEADER.format(name=host) + _dump(boot) for host, boot in boots.items()}


def prometheus_config() -> str:
    text = base.prometheus_config()  # over this variant's SIDECARS and HOSTS (set above)
    assert text.startswith(BASE_PROM_HEADER)
    return PROM_HEADER + text[len(BASE_PROM_HEADER):]


def main() -> int:
    outputs = {HERE / name: text for name, text in render_all().items()}
    outputs[PROMETHEUS_PATH] = prometheus_config()
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
