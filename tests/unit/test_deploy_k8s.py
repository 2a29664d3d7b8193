"""deploy/k8s: both overlays render with kustomize, every document satisfies the Kubernetes
schema of a current release (strict: unknown fields are errors), and the manifests keep the
promises of docs/deploy.md (probes, resources, disruption budgets, autoscaling, network
policies, one engine per GPU node)."""
from __future__ import annotations

import pytest

from tests.unit.deploy_tools import K8S_DIR, K8S_VERSION, kustomize, probe_target

OVERLAYS = ("cpu", "gpu", "cpu-mtls")


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
            if overlay != "cpu-mtls":
                assert "grpc" in c["readinessProbe"] and "grpc" in c["livenessProbe"], where
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
