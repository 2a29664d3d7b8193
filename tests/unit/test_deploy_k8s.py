"""deploy/k8s: every overlay renders with kustomize, every document satisfies the Kubernetes
schema of a current release (strict: unknown fields are errors), and the manifests keep the
promises of docs/deploy.md (probes, resources, disruption budgets, autoscaling, network
policies, one engine per GPU node; overlays/pd and pd-mtls: one prefill and one decode engine;
cpu-mtls and pd-mtls: their plain overlay's mesh with every internal hop over mTLS)."""
from __future__ import annotations

import pytest
import yaml

from tests.unit.deploy_tools import K8S_DIR, K8S_VERSION, kustomize, probe_target

OVERLAYS = ("cpu", "gpu", "cpu-mtls", "pd", "pd-mtls")
MTLS = {"cpu-mtls": "cpu", "pd-mtls": "pd"}  # the internal-mTLS overlays and the plain one each adds it to
PD_OVERLAYS = ("pd", "pd-mtls")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: kustomize(K8S_DIR / "overlays" / o) for o in OVERLAYS}


def _kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _workloads(docs):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_validates_against_the_kubernetes_schema(rendered, overlay):
    import kubernetes_validate
    docs = rendered[overlay]
    assert len(docs) > 20
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_schema_check_rejects_a_broken_manifest(rendered):
    import copy

    import kubernetes_validate
    dep = copy.deepcopy(_kind(rendered["cpu"], "Deployment")["gateway"])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"  # must be int
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    dep = copy.deepcopy(_kind(rendered["cpu"], "Deployment")["gateway"])
    dep["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_health_probes_and_bounded_resources(rendered, overlay):
    for name, w in _workloads(rendered[overlay]).items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            where = f"{overlay}: {name}/{c['name']}"
            assert probe_target(c["readinessProbe"])[1], f"{where}: readiness must name the service"
            assert probe_target(c["livenessProbe"])[1] == "", f"{where}: liveness asks the process only"
            probes = [c[p] for p in ("readinessProbe", "livenessProbe", "startupProbe") if p in c]
            if overlay not in MTLS or name == "gateway":  # the gateway's public ports keep native probes
                assert all("grpc" in p for p in probes), where
            else:  # kubelet's grpc probes cannot do TLS: every internal port is probed over mTLS
                assert all("exec" in p and "--tls" in p["exec"]["command"] for p in probes), where
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"]), where
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
        assert w["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_has_a_disruption_budget_and_the_gateway_an_autoscaler(rendered, overlay):
    docs = rendered[overlay]
    pdbs = _kind(docs, "PodDisruptionBudget").values()
    for name, w in _workloads(docs).items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())
                   for p in pdbs), f"{name} has no PodDisruptionBudget"
    hpa = _kind(docs, "HorizontalPodAutoscaler")["gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    assert hpa["spec"]["minReplicas"] >= 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_is_reachable_from_outside(rendered, overlay):
    docs = rendered[overlay]
    services = _kind(docs, "Service")
    exposed = [n for n, s in services.items() if s["spec"].get("type", "ClusterIP") != "ClusterIP"]
    assert exposed == ["gateway"]
    policies = _kind(docs, "NetworkPolicy")
    deny = policies["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    for name, w in _workloads(docs).items():
        pol = policies.get(f"allow-{name}")
        assert pol is not None, f"{name} has no NetworkPolicy"
        for rule in pol["spec"]["ingress"]:
            if name == "gateway":
                continue
            # everyone else: only named pods, or the monitoring namespace for /metrics
            assert rule.get("from"), f"{name} admits traffic from anywhere: {rule}"


TLS_ENV = {"MESHLLM_INTERNAL_TLS_CERTFILE", "MESHLLM_INTERNAL_TLS_KEYFILE", "MESHLLM_INTERNAL_TLS_CA_CERTS"}
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


def _without_internal_tls(doc: dict) -> dict:
    """A workload less what components/internal-mtls adds: the TLS environment, the Secret
    volumes meshllm-tls-* and their mounts, and the probes (compared on their own)."""
    import copy
    doc = copy.deepcopy(doc)
    pod = doc["spec"]["template"]["spec"]
    tls = {v["name"] for v in pod.get("volumes", [])
           if v.get("secret", {}).get("secretName", "").startswith("meshllm-tls-")}
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in tls]
    for c in pod["containers"]:
        c["env"] = [e for e in c.get("env", []) if e["name"] not in TLS_ENV]
        c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if m["name"] not in tls]
        for key in PROBES:
            c.pop(key, None)
        for key in ("env", "volumeMounts"):
            if not c[key]:
                del c[key]
    if not pod["volumes"]:
        del pod["volumes"]
    return doc


@pytest.mark.parametrize("overlay", list(MTLS))
def test_the_mtls_overlays_are_their_plain_overlay_with_every_container_on_internal_tls(rendered, overlay):
    """cpu-mtls is cpu and pd-mtls is pd, document for document, but for the TLS settings: every
    container gets the three MESHLLM_INTERNAL_TLS_* paths (its servers then require mTLS and its
    channels speak it: no plaintext internal hop), and each probe asks what the plain probe asks."""
    plain = {(d["kind"], d["metadata"]["name"]): d for d in rendered[MTLS[overlay]]}
    mtls = {(d["kind"], d["metadata"]["name"]): d for d in rendered[overlay]}
    assert set(mtls) == set(plain), sorted(set(mtls) ^ set(plain))
    for key, doc in mtls.items():
        if key[0] not in ("Deployment", "StatefulSet"):
            assert doc == plain[key], key
            continue
        assert _without_internal_tls(doc) == _without_internal_tls(plain[key]), key
        plain_containers = {c["name"]: c for c in plain[key]["spec"]["template"]["spec"]["containers"]}
        for c in doc["spec"]["template"]["spec"]["containers"]:
            where = f"{overlay}: {key[1]}/{c['name']}"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert TLS_ENV <= set(env), f"{where} runs without internal TLS"
            mounted = {m["mountPath"] for m in c["volumeMounts"]}
            assert {v.rsplit("/", 1)[0] for n, v in env.items() if n in TLS_ENV} <= mounted, where
            for p in PROBES:
                was = plain_containers[c["name"]].get(p)
                if was is None and p == "startupProbe" and p in c:  # one the plain overlay lacks (kvstore)
                    assert probe_target(c[p]) == probe_target(c["livenessProbe"]), (where, p)
                    continue
                assert (p in c) == (was is not None), (where, p)
                if was is not None:
                    (port, service), (was_port, was_service) = probe_target(c[p]), probe_target(was)
                    assert port == was_port, (where, p)
                    # a startup probe may ask liveness instead (the component's supervisor one does)
                    allowed = {was_service, ""} if p == "startupProbe" else {was_service}
                    assert service in allowed, (where, p, service)
                    assert {k: c[p].get(k) for k in ("periodSeconds", "failureThreshold")} == \
                        {k: was.get(k) for k in ("periodSeconds", "failureThreshold")}, (where, p)


def test_gpu_overlay_puts_one_engine_on_each_gpu_node(rendered):
    engine = _kind(rendered["gpu"], "StatefulSet")["engine"]
    spec = engine["spec"]["template"]["spec"]
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--device=cuda" in worker["args"] and worker["image"] == "meshllm:cuda"
    # Triton writes compiled kernels: a writable cache under the read-only root filesystem
    assert {"name": "triton-cache", "mountPath": "/var/lib/meshllm/triton"} in worker["volumeMounts"]
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    # the gateway routes to every engine replica
    gateway = _kind(rendered["gpu"], "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    routed = {a.split("=", 1)[1] for a in gateway["args"] if a.startswith("--engine-addr=engine-")}
    assert routed == {f"engine-{i}.engine:50053" for i in range(engine["spec"]["replicas"])}
    # the supervisor's own engine never shares a node with a StatefulSet engine
    sup = _kind(rendered["gpu"], "Deployment")["supervisor"]["spec"]["template"]["spec"]
    term = sup["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"] == engine["spec"]["selector"]["matchLabels"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert sup["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    cpu_engine = _kind(rendered["cpu"], "StatefulSet")["engine"]["spec"]["template"]["spec"]
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in cpu_engine["containers"])


# ---- overlays/pd ---------------------------------------------------------------------------

PD_ENGINES = {"prefill": "engine-prefill", "decode": "engine-decode"}
COLOCATED = {"pd": "cpu", "pd-mtls": "cpu-mtls"}  # the overlay whose engine each PD overlay runs twice


def _args(workload: dict, container: str) -> list[str]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == container)["args"]


def _flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]


@pytest.mark.parametrize("overlay", PD_OVERLAYS)
def test_pd_has_a_prefill_and_a_decode_engine_and_no_colocated_one(rendered, overlay):
    docs = rendered[overlay]
    sts = _kind(docs, "StatefulSet")
    assert set(sts) == set(PD_ENGINES.values()), sorted(sts)
    for role, name in PD_ENGINES.items():
        sched = _args(sts[name], "scheduler")
        assert _flag(sched, "--kv-role") == [role], (name, sched)
        assert _flag(sched, "--kv-load-failure-policy") == ["recompute"], name
        for container in ("scheduler", "worker"):
            assert _flag(_args(sts[name], container), "--kvstore-addr") == ["kvstore:50070"], (name, container)
        assert sts[name]["spec"]["template"]["metadata"]["labels"]["meshllm.io/kv-role"] == role
        assert sts[name]["spec"]["replicas"] == 1
    ids = {name: _flag(_args(sts[name], "scheduler"), "--engine-id") for name in sts}
    assert ids == {name: _flag(_args(sts[name], "worker"), "--engine-id") for name in sts}
    assert len({tuple(v) for v in ids.values()}) == 2, ids
    # the kvstore from the base; the colocated engine and the supervisor (engine-1) are gone
    assert "kvstore" in _kind(docs, "Deployment") and "kvstore" in _kind(docs, "Service")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in (("StatefulSet", "engine"), ("Service", "engine"), ("Deployment", "supervisor"),
                       ("Service", "supervisor"), ("NetworkPolicy", "allow-engine"),
                       ("NetworkPolicy", "allow-supervisor"), ("PodDisruptionBudget", "supervisor")):
        assert (kind, name) not in names, (kind, name)
    assert not [d for d in docs if d["metadata"]["name"].startswith("meshllm-supervisor-spec")]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"meshllm"}


@pytest.mark.parametrize("overlay", PD_OVERLAYS)
def test_the_pd_gateway_and_profiler_reach_both_engines_and_otherwise_match_the_cpu_overlay(rendered, overlay):
    gw = _args(_kind(rendered[overlay], "Deployment")["gateway"], "gateway")
    assert sorted(_flag(gw, "--engine-addr")) == sorted(f"{n}-0.{n}:50053" for n in PD_ENGINES.values())
    cpu_gw = _args(_kind(rendered[COLOCATED[overlay]], "Deployment")["gateway"], "gateway")
    assert [a for a in gw if not a.startswith("--engine-addr=")] == \
        [a for a in cpu_gw if not a.startswith("--engine-addr=")]
    prof = _args(_kind(rendered[overlay], "Deployment")["profiler"], "profiler")
    reached = {a.rsplit("=", 1)[1] for a in prof if a.startswith(("--worker=", "--service="))}
    for n in PD_ENGINES.values():
        assert {f"{n}-0.{n}:50053", f"{n}-0.{n}:50054"} <= reached, (n, reached)
    engine_targets = ("--worker=engine", "--service=scheduler", "--service=prefill-", "--service=decode-")
    cpu_prof = _args(_kind(rendered[COLOCATED[overlay]], "Deployment")["profiler"], "profiler")
    assert [a for a in prof if not a.startswith(engine_targets)] == \
        [a for a in cpu_prof if not a.startswith(engine_targets)]


def _strip_variant(doc: dict) -> dict:
    import copy
    doc = copy.deepcopy(doc)
    doc["metadata"].get("labels", {}).pop("meshllm.io/variant", None)
    return doc


@pytest.mark.parametrize("overlay", PD_OVERLAYS)
def test_the_pd_engines_are_the_base_engine_in_two_roles(rendered, overlay):
    """Each PD engine (StatefulSet, headless Service, budget, policy) is the base engine's with
    only its name, its pod labels and the schedulers' role flags changed (in pd-mtls: cpu-mtls's
    engine, and its identities <role>-scheduler / <role>-worker): a change to base/engine.yaml or
    to the component's engine patch that the PD engines miss fails here."""
    cpu = rendered[COLOCATED[overlay]]
    base = {kind: _strip_variant(_kind(cpu, kind)[name]) for kind, name in (
        ("StatefulSet", "engine"), ("Service", "engine"), ("PodDisruptionBudget", "engine"),
        ("NetworkPolicy", "allow-engine"))}
    for role, name in PD_ENGINES.items():
        sts = _strip_variant(_kind(rendered[overlay], "StatefulSet")[name])
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert labels == {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "engine",
                          "meshllm.io/kv-role": role}, labels
        sts["spec"]["template"]["metadata"]["labels"] = {"app.kubernetes.io/name": name}
        engine_id = _flag(_args(sts, "scheduler"), "--engine-id")
        for c in sts["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "scheduler":  # the base scheduler's flags, then these three
                extra = [f"--engine-id={engine_id[0]}", f"--kv-role={role}", "--kv-load-failure-policy=recompute"]
                assert c["args"][-3:] == extra, (name, c["args"])
                del c["args"][-3:]
            c["args"] = [a if not a.startswith("--engine-id=") else "--engine-id=0" for a in c["args"]]
        expected = {"StatefulSet": sts, "Service": _strip_variant(_kind(rendered[overlay], "Service")[name]),
                    "PodDisruptionBudget": _strip_variant(_kind(rendered[overlay], "PodDisruptionBudget")[name]),
                    "NetworkPolicy": _strip_variant(_kind(rendered[overlay], "NetworkPolicy")[f"allow-{name}"])}
        for kind, doc in expected.items():  # named as the base's, they are the base's
            text = yaml.safe_dump(doc).replace(f"allow-{name}", "allow-engine").replace(
                f"serviceName: {name}", "serviceName: engine").replace(f": {name}\n", ": engine\n").replace(
                f"{role}-scheduler", "scheduler").replace(f"{role}-worker", "worker")  # pd-mtls' identities
            assert yaml.safe_load(text) == base[kind], (role, kind)


@pytest.mark.parametrize("overlay", PD_OVERLAYS)
def test_pd_network_policies_admit_the_engines_callers_and_only_them(rendered, overlay):
    docs = rendered[overlay]
    policies = _kind(docs, "NetworkPolicy")
    kv = policies["allow-kvstore"]["spec"]["ingress"]
    callers = [f["podSelector"]["matchLabels"] for rule in kv if any(p["port"] == 50070 for p in rule["ports"])
               for f in rule["from"]]
    assert sorted(c["app.kubernetes.io/name"] for c in callers) == sorted(PD_ENGINES.values()), callers
    for name in PD_ENGINES.values():
        pol = policies[f"allow-{name}"]["spec"]
        assert pol["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": name}}
        sched = [f["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for rule in pol["ingress"]
                 if any(p["port"] == 50053 for p in rule["ports"]) for f in rule["from"]]
        assert sorted(sched) == ["gateway", "profiler"], (name, sched)
