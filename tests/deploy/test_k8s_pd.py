"""The pd overlay (k8s/overlays/pd): a prefill and a decode engine pool, Redis, the router in
front, checked offline: rendered with ``kubectl kustomize``, validated against the API schemas,
and the wiring asserted on the rendered objects (roles, the router's replica list, the Redis the
offload-stores share, who may reach Redis, and that the two pools' pods are the same but for
their role)."""

from __future__ import annotations

import copy
import subprocess
from typing import Any

import pytest
import yaml

from services.router.config import RouterConfig
from services.router.types import ReplicaAddress
from services.scheduler.config import SchedulerConfig
from shared.config import from_env
from tests.deploy.test_k8s import K8S_VERSIONS, REPO

Doc = dict[str, Any]
ROLE = "kvmesh.dev/role"


@pytest.fixture(scope="module")
def rendered(kubectl_bin: str) -> tuple[str, list[Doc]]:
    result = subprocess.run([kubectl_bin, "kustomize", str(REPO / "k8s" / "overlays" / "pd")],
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


def _container(pod: Doc, name: str) -> Doc:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return c


def _selects(selector: Doc, labels: Doc) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pd_overlay_validates_against_the_api_schema(rendered: tuple[str, list[Doc]], version: str,
                                                      kubernetes_validate_cmd: list[str]) -> None:
    result = subprocess.run([*kubernetes_validate_cmd, "-k", version, "--strict", "--quiet", "-"],
                            input=rendered[0], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_engine_pools_by_role_and_a_redis(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    deps = _kind(docs, "Deployment")
    assert set(deps) == {"engine", "engine-prefill", "router", "gateway"}
    assert set(_kind(docs, "StatefulSet")) == {"redis"}
    for name, role in (("engine", "decode"), ("engine-prefill", "prefill")):
        dep = deps[name]
        assert dep["spec"]["replicas"] == 1
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels[ROLE] == role and labels["app.kubernetes.io/component"] == "engine"
        assert dep["spec"]["selector"]["matchLabels"][ROLE] == role
        env = _env(_container(dep["spec"]["template"], "scheduler"))
        assert from_env(SchedulerConfig, "KVMESH_SCHED_", env).role == role
    # Neither Deployment's selector takes the other's pods.
    for a, b in (("engine", "engine-prefill"), ("engine-prefill", "engine")):
        pod_labels = deps[b]["spec"]["template"]["metadata"]["labels"]
        assert not _selects(deps[a]["spec"]["selector"]["matchLabels"], pod_labels)


def test_prefill_pod_is_the_decode_pod_but_for_its_role(rendered: tuple[str, list[Doc]]) -> None:
    """engine-prefill.yaml states the mesh's engine pod again: this keeps the copy honest."""
    _text, docs = rendered
    deps = _kind(docs, "Deployment")

    def without_role(name: str) -> Doc:
        tpl = copy.deepcopy(deps[name]["spec"]["template"])
        del tpl["metadata"]["labels"][ROLE]
        sched = _container(tpl, "scheduler")
        sched["env"] = [e for e in sched["env"] if e["name"] != "KVMESH_SCHED_ROLE"]
        return tpl

    assert without_role("engine-prefill") == without_role("engine")


def test_router_lists_the_two_roles_by_name(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    router = _container(_kind(docs, "Deployment")["router"]["spec"]["template"], "router")
    env = _env(router)
    assert not [k for k in env if k.startswith("KVMESH_ROUTER_DISCOVERY")]
    config = from_env(RouterConfig, "KVMESH_ROUTER_", {**_values(docs), **env})
    assert config.discovery_target() is None and config.pd_threshold_tokens == 256
    assert config.replica_addresses() == (
        ReplicaAddress("p", "engine-prefill:50051", "engine-prefill:50052", "prefill", "engine-prefill:50054"),
        ReplicaAddress("d", "engine-decode:50051", "engine-decode:50052", "decode", "engine-decode:50054"))
    svcs = _kind(docs, "Service")
    deps = _kind(docs, "Deployment")
    for svc, dep in (("engine-prefill", "engine-prefill"), ("engine-decode", "engine")):
        spec = svcs[svc]["spec"]
        assert spec["clusterIP"] == "None"
        assert {p["port"] for p in spec["ports"]} == {50051, 50052}
        assert _selects(spec["selector"], deps[dep]["spec"]["template"]["metadata"]["labels"])
        other = "engine" if dep == "engine-prefill" else "engine-prefill"
        assert not _selects(spec["selector"], deps[other]["spec"]["template"]["metadata"]["labels"])
    # The router verifies the name every engine certificate carries, whichever pool it dials.
    assert env["KVMESH_TLS_SERVER_NAME"] == "engine"


def test_offload_stores_share_the_redis_and_only_engines_reach_it(rendered: tuple[str, list[Doc]]) -> None:
    _text, docs = rendered
    assert _values(docs)["KVMESH_OFFLOAD_REMOTE_URL"] == "redis://redis:6379/0"
    deps = _kind(docs, "Deployment")
    for name in ("engine", "engine-prefill"):
        store = _container(deps[name]["spec"]["template"], "offload-store")
        assert any(ref.get("configMapRef", {}).get("name", "").startswith("kvmesh-values") for ref in store["envFrom"])
    redis = _kind(docs, "StatefulSet")["redis"]["spec"]
    (c,) = redis["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in args
    svc = _kind(docs, "Service")["redis"]["spec"]
    assert [p["port"] for p in svc["ports"]] == [6379]
    assert _selects(svc["selector"], redis["template"]["metadata"]["labels"])
    policy = _kind(docs, "NetworkPolicy")["redis"]["spec"]
    assert _selects(policy["podSelector"]["matchLabels"], redis["template"]["metadata"]["labels"])
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    (peer,) = rule["from"]
    for name in ("engine", "engine-prefill"):
        assert _selects(peer["podSelector"]["matchLabels"], deps[name]["spec"]["template"]["metadata"]["labels"])
    assert not _selects(peer["podSelector"]["matchLabels"], deps["router"]["spec"]["template"]["metadata"]["labels"])
