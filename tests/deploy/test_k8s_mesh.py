"""The mesh overlay (k8s/overlays/mesh): engine pods behind the router, checked offline.

``kubectl kustomize`` renders it and kubernetes-validate checks it against the API schemas, as
for the other overlays (test_k8s.py); the assertions read the rendered objects: the wiring the
router's DNS discovery, the NetworkPolicies and the certificates rely on.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from services.router.config import RouterConfig
from shared.config import from_env
from shared.grpc_server import LIVENESS_SERVICE
from tests.deploy.test_k8s import GRPC_PORTS, HEALTH_PORTS, K8S_VERSIONS, METRICS_PORTS, REPO

Doc = dict[str, Any]
ROUTER_PORT, ROUTER_METRICS, ROUTER_HEALTH = 50050, 9095, 50060


@pytest.fixture(scope="module")
def rendered(kubectl_bin: str) -> tuple[str, list[Doc]]:
    result = subprocess.run([kubectl_bin, "kustomize", str(REPO / "k8s" / "overlays" / "mesh")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout, [d for d in yaml.safe_load_all(result.stdout) if d]


def _kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _env(container: Doc) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _values(docs: list[Doc]) -> dict[str, str]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvmesh-values")]
    data: dict[str, str] = cm["data"]
    return data


def _pod(docs: list[Doc], name: str) -> Doc:
    spec: Doc = _kind(docs, "Deployment")[name]["spec"]["template"]["spec"]
    return spec


def _selects(selector: Doc, labels: Doc) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_mesh_overlay_validates_against_the_api_schema(rendered: tuple[str, list[Doc]], version: str,
                                                        kubernetes_validate_cmd: list[str]) -> None:
    result = subprocess.run([*kubernetes_validate_cmd, "-k", version, "--strict", "--quiet", "-"],
                            input=rendered[0], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_engine_router_and_gateway_run(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    assert set(_kind(docs, "Deployment")) == {"engine", "router", "gateway"}
    assert set(_kind(docs, "Service")) == {"engine", "router", "gateway"}
    assert set(_kind(docs, "NetworkPolicy")) == {"engine", "router", "gateway"}
    assert set(_kind(docs, "PodDisruptionBudget")) == {"engine", "router"}


def test_engine_pod_is_one_whole_replica_scaled_to_two(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    dep = _kind(docs, "Deployment")["engine"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    spec = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == list(GRPC_PORTS)
    for c in spec["containers"]:
        name = c["name"]
        assert c["args"] == ["serve", name]
        env = _env(c)
        assert (env["KVMESH_PORT"], env["KVMESH_METRICS_PORT"], env["KVMESH_HEALTH_PORT"]) == (
            str(GRPC_PORTS[name]), str(METRICS_PORTS[name]), str(HEALTH_PORTS[name]))
        assert {p["containerPort"] for p in c["ports"]} == {GRPC_PORTS[name], METRICS_PORTS[name]}
        assert c["readinessProbe"]["grpc"] == {"port": HEALTH_PORTS[name]}
        assert c["livenessProbe"]["grpc"] == {"port": HEALTH_PORTS[name], "service": LIVENESS_SERVICE}
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["lifecycle"]["preStop"]["sleep"]["seconds"] + 25 + 3 < spec["terminationGracePeriodSeconds"]
    # The scheduler dials its own pod's services over loopback, by the names their certificates carry.
    assert spec["hostAliases"] == [{"ip": "127.0.0.1", "hostnames": ["kv-cache-manager", "model-runner",
                                                                    "offload-store"]}]
    values = _values(docs)
    assert (values["KVMESH_SCHED_KVM_ADDRESS"], values["KVMESH_SCHED_RUNNER_ADDRESS"],
            values["KVMESH_SCHED_OFFLOAD_ADDRESS"]) == ("kv-cache-manager:50052", "model-runner:50053",
                                                         "offload-store:50054")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    by_name = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in spec["containers"]}
    assert by_name["model-runner"]["/dev/shm"] == by_name["offload-store"]["/dev/shm"] == "dshm"
    tls = {n: volumes[m["/etc/kvmesh/tls"]]["secret"]["secretName"] for n, m in by_name.items()}
    assert tls == {"scheduler": "kvmesh-tls-scheduler", "kv-cache-manager": "kvmesh-tls-kv-cache-manager",
                   "model-runner": "kvmesh-tls-model-runner", "offload-store": "kvmesh-tls-model-runner"}
    (prep,) = spec["initContainers"]
    assert prep["args"] == ["model", "prepare"]


def test_kvm_and_offload_store_admit_the_router_the_rest_only_the_scheduler(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    peers = {c["name"]: _env(c).get("KVMESH_TLS_ALLOWED_PEERS") for c in _pod(docs, "engine")["containers"]}
    assert peers == {"scheduler": None, "kv-cache-manager": "scheduler,router",
                     "model-runner": "scheduler", "offload-store": "scheduler,router"}
    sched = next(c for c in _pod(docs, "engine")["containers"] if c["name"] == "scheduler")
    assert _env(sched)["KVMESH_AUTH_MODE"] == "on"


def test_headless_service_selects_the_engine_pods(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    svc = _kind(docs, "Service")["engine"]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is False
    labels = _kind(docs, "Deployment")["engine"]["spec"]["template"]["metadata"]["labels"]
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in _kind(docs, "Deployment").items()}
    assert [n for n, lab in pods.items() if _selects({"matchLabels": svc["selector"]}, lab)] == ["engine"]
    assert svc["selector"].items() <= labels.items()
    assert {(p["port"], p["targetPort"]) for p in svc["ports"]} == {(50051, "grpc"), (50052, "grpc-kvm"),
                                                                    (9091, "metrics")}


def test_router_discovers_the_headless_service(rendered: tuple[str, list[Doc]]) -> None:
    """The router's env, read as its main.py reads it, resolves the engine Service's ports."""
    _text, docs = rendered
    dep = _kind(docs, "Deployment")["router"]
    assert dep["spec"]["replicas"] == 2
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"] == ["serve", "router"]
    env = _env(c)
    config = from_env(RouterConfig, "KVMESH_ROUTER_", {**_values(docs), **env})
    target = config.discovery_target()
    assert target is not None and (target.name, target.scheduler_port, target.kvm_port, target.offload_port) == (
        "engine", 50051, 50052, 50054)
    assert config.replicas == "" and config.discovery_interval_seconds == 5.0
    assert target.name in _kind(docs, "Service")  # the headless Service of the same namespace
    assert env["KVMESH_TLS_SERVER_NAME"] == "engine"  # the SAN the replicas' certificates carry
    assert (env["KVMESH_PORT"], env["KVMESH_METRICS_PORT"], env["KVMESH_HEALTH_PORT"]) == (
        str(ROUTER_PORT), str(ROUTER_METRICS), str(ROUTER_HEALTH))
    assert c["readinessProbe"]["grpc"] == {"port": ROUTER_HEALTH}
    assert c["startupProbe"]["grpc"] == {"port": ROUTER_HEALTH}
    assert c["livenessProbe"]["grpc"] == {"port": ROUTER_HEALTH, "service": LIVENESS_SERVICE}
    assert env["KVMESH_AUTH_MODE"] == "on"
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/etc/kvmesh/tls"]]["secret"]["secretName"] == "kvmesh-tls-router"
    assert volumes[mounts["/etc/kvmesh/api-keys"]]["secret"]["secretName"] == "kvmesh-api-keys"
    # Same deployment key as the engine's scheduler and kv-cache-manager.
    refs = {e["secretRef"]["name"] for e in c["envFrom"] if "secretRef" in e}
    engine_refs = {e["secretRef"]["name"] for x in _pod(docs, "engine")["containers"][:2]
                   for e in x["envFrom"] if "secretRef" in e}
    assert refs == engine_refs and refs <= set(_kind(docs, "Secret"))
    svc = _kind(docs, "Service")["router"]["spec"]
    assert {(p["port"], p["targetPort"]) for p in svc["ports"]} == {(ROUTER_PORT, "grpc"), (ROUTER_METRICS, "metrics")}
    assert _values(docs)["KVMESH_GATEWAY_SCHEDULER_ADDRESS"] == f"router:{ROUTER_PORT}"


def test_network_policies_let_only_the_router_reach_the_replicas(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in _kind(docs, "Deployment").items()}
    policies = _kind(docs, "NetworkPolicy")
    (engine,) = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods["engine"])]
    assert engine["spec"]["policyTypes"] == ["Ingress"]
    rules = engine["spec"]["ingress"]
    grpc_rules = [r for r in rules if {p["port"] for p in r["ports"]} & set(GRPC_PORTS.values())]
    (rule,) = grpc_rules
    assert {p["port"] for p in rule["ports"]} == {50051, 50052, 50054}  # never 50053: loopback only
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}
    assert [n for n, lab in pods.items() if _selects(peer["podSelector"], lab)] == ["router"]
    others = {p["port"] for r in rules if r is not rule for p in r["ports"]}
    assert others == set(METRICS_PORTS.values())
    (router,) = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods["router"])]
    assert {p["port"] for r in router["spec"]["ingress"] for p in r["ports"]} == {ROUTER_PORT, ROUTER_METRICS}
    open_rule = next(r for r in router["spec"]["ingress"] if "from" not in r)
    assert [p["port"] for p in open_rule["ports"]] == [ROUTER_PORT]


def test_disruption_budgets_keep_one_replica_and_one_router(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in _kind(docs, "Deployment").items()}
    for name, pdb in _kind(docs, "PodDisruptionBudget").items():
        assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
        assert [n for n, lab in pods.items() if _selects(pdb["spec"]["selector"], lab)] == [name]
