"""Kubernetes manifests: each overlay renders, validates against the API schemas, and keeps the
properties the deployment relies on (probes, restricted security, shared /dev/shm, network policy).

Everything runs offline: ``kubectl kustomize`` needs no cluster, and kubernetes-validate carries
the JSON schemas of each Kubernetes release.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.grpc_server import LIVENESS_SERVICE

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")
# The oldest release we support (native preStop sleep is on by default from 1.30; grpc probes
# are GA from 1.27) and the newest the pinned kubernetes-validate knows.
K8S_VERSIONS = ("1.32.0", "1.37.0")
GRPC_PORTS = {"scheduler": 50051, "kv-cache-manager": 50052, "model-runner": 50053, "offload-store": 50054}
# Plaintext ports answering grpc.health.v1 only: the kubelet's probes cannot present a certificate.
HEALTH_PORTS = {"scheduler": 50061, "kv-cache-manager": 50062, "model-runner": 50063, "offload-store": 50064}
METRICS_PORTS = {"scheduler": 9091, "kv-cache-manager": 9092, "model-runner": 9093, "offload-store": 9094}
HTTP_PORT = 8000  # the gateway: HTTP API, /health and /metrics on one port
UID = 10001

Doc = dict[str, Any]


def _render(kubectl: str, overlay: str) -> str:
    result = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, kubectl_bin: str) -> tuple[str, str, list[Doc]]:
    """(name, rendered YAML, parsed documents) of one overlay."""
    text = _render(kubectl_bin, request.param)
    docs = [d for d in yaml.safe_load_all(text) if d]
    return request.param, text, docs


def _kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """(deployment name, pod template metadata, pod spec) of every Deployment."""
    for name, dep in _kind(docs, "Deployment").items():
        yield name, dep["spec"]["template"]["metadata"], dep["spec"]["template"]["spec"]


def _values(docs: list[Doc]) -> dict[str, str]:
    (cm,) = [d for d in docs
             if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvmesh-values")]
    data: dict[str, str] = cm["data"]
    return data


def _env(container: Doc) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_overlay_validates_against_the_api_schema(overlay: tuple[str, str, list[Doc]], version: str,
                                                   kubernetes_validate_cmd: list[str]) -> None:
    _name, text, _docs = overlay
    result = subprocess.run([*kubernetes_validate_cmd, "-k", version, "--strict", "--quiet", "-"],
                            input=text, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_container_has_grpc_probes_on_its_own_health_port(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    seen = set()
    for dep, _meta, spec in _pod_specs(docs):
        if dep == "gateway":
            continue
        for c in spec["containers"]:
            port = GRPC_PORTS[c["name"]]
            seen.add(c["name"])
            assert _env(c)["KVMESH_PORT"] == str(port)
            assert _env(c)["KVMESH_METRICS_PORT"] == str(METRICS_PORTS[c["name"]])
            assert {p["containerPort"] for p in c["ports"]} == {port, METRICS_PORTS[c["name"]]}
            health = HEALTH_PORTS[c["name"]]
            assert _env(c)["KVMESH_HEALTH_PORT"] == str(health)
            # Readiness follows dependencies; liveness asks for the name that stays SERVING while
            # the process runs, so a dependency outage unreadies a pod without restarting it.
            assert c["readinessProbe"]["grpc"] == {"port": health}, c["name"]
            assert c["livenessProbe"]["grpc"] == {"port": health, "service": LIVENESS_SERVICE}, c["name"]
            if "startupProbe" in c:
                assert c["startupProbe"]["grpc"] == {"port": health}
    assert seen == set(GRPC_PORTS)


def test_gateway_has_http_probes_on_health_and_dials_the_scheduler(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    spec = _kind(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"] == ["serve", "gateway"]
    assert _env(c)["KVMESH_PORT"] == str(HTTP_PORT)
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", HTTP_PORT)]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert _values(docs)["KVMESH_GATEWAY_SCHEDULER_ADDRESS"] == f"scheduler:{GRPC_PORTS['scheduler']}"
    svc = _kind(docs, "Service")["gateway"]
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(HTTP_PORT, "http")]
    (policy,) = [p for p in _kind(docs, "NetworkPolicy").values()
                 if p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "gateway"]
    assert [p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]] == [HTTP_PORT]


def _assert_restricted(ctx: Doc, where: str) -> None:
    assert ctx.get("runAsNonRoot") is True, where
    assert ctx.get("runAsUser") == UID, where
    assert ctx.get("allowPrivilegeEscalation") is False, where
    assert ctx.get("readOnlyRootFilesystem") is True, where
    assert ctx.get("capabilities") == {"drop": ["ALL"]}, where
    assert ctx.get("seccompProfile") == {"type": "RuntimeDefault"}, where


def test_restricted_security_context_resources_and_writable_tmp(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    for dep, _meta, spec in _pod_specs(docs):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == UID
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{dep}/{c['name']}"
            _assert_restricted(c["securityContext"], where)
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][section]), where
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], where
            assert not c["image"].endswith(":latest"), where


def test_runner_and_store_share_a_memory_backed_dev_shm(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    spec = _kind(docs, "Deployment")["model-runner"]["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True
    assert [c["name"] for c in spec["containers"]] == ["model-runner", "offload-store"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = {next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
           for c in spec["containers"]}
    assert len(shm) == 1
    (shm_name,) = shm
    assert volumes[shm_name]["emptyDir"]["medium"] == "Memory"
    assert volumes[shm_name]["emptyDir"]["sizeLimit"]


def test_model_prepare_init_container_fills_the_runners_cache(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    values = _values(docs)
    cache_dir = values["KVMESH_CACHE_DIR"]
    assert values["KVMESH_MODEL_DIR"].startswith(cache_dir + "/")
    for dep in ("model-runner", "scheduler"):
        spec = _kind(docs, "Deployment")[dep]["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        assert init["args"] == ["model", "prepare"]
        init_mount = next(m for m in init["volumeMounts"] if m["mountPath"] == cache_dir)
        assert not init_mount.get("readOnly", False)
        main = spec["containers"][0]
        main_mount = next(m for m in main["volumeMounts"] if m["mountPath"] == cache_dir)
        assert main_mount["name"] == init_mount["name"] and main_mount["readOnly"] is True


def _selects(selector: Doc, labels: Doc) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_network_policy_lets_only_the_scheduler_in(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    pods = {name: meta["labels"] for name, meta, _spec in _pod_specs(docs)}
    policies = _kind(docs, "NetworkPolicy")
    protected = {"kv-cache-manager": {50052}, "model-runner": {50053, 50054}}
    for target, grpc_ports in protected.items():
        (policy,) = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods[target])]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if ports & grpc_ports:
                # Only from pods in this namespace that are the scheduler, and nothing else.
                assert ports == grpc_ports
                (peer,) = rule["from"]
                assert set(peer) == {"podSelector"}
                matched = [name for name, labels in pods.items() if _selects(peer["podSelector"], labels)]
                assert matched == ["scheduler"]
            else:
                assert ports <= set(METRICS_PORTS.values())
    # The scheduler's API stays open; its policy only limits which ports are reachable.
    (sched,) = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods["scheduler"])]
    assert {p["port"] for r in sched["spec"]["ingress"] for p in r["ports"]} == {50051, 9091}


def test_services_reach_the_right_pods_and_ports(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    pods = {name: (meta["labels"], spec) for name, meta, spec in _pod_specs(docs)}
    services = _kind(docs, "Service")
    assert set(services) == set(GRPC_PORTS) | {"gateway"}
    for name, svc in services.items():
        if name == "gateway":
            continue
        selector = {"matchLabels": svc["spec"]["selector"]}
        matched = [p for p, (labels, _) in pods.items() if _selects(selector, labels)]
        assert len(matched) == 1, name
        spec = pods[matched[0]][1]
        named = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c["ports"]}
        by_port = {p["port"]: named[p["targetPort"]] for p in svc["spec"]["ports"]}
        assert by_port == {GRPC_PORTS[name]: GRPC_PORTS[name], METRICS_PORTS[name]: METRICS_PORTS[name]}
    # The scheduler dials the others through these Services.
    values = _values(docs)
    assert values["KVMESH_SCHED_KVM_ADDRESS"] == "kv-cache-manager:50052"
    assert values["KVMESH_SCHED_RUNNER_ADDRESS"] == "model-runner:50053"
    assert values["KVMESH_SCHED_OFFLOAD_ADDRESS"] == "offload-store:50054"
    assert values["KVMESH_HOST"] == "0.0.0.0"


def test_pods_drain_before_they_are_killed(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    grace = float(_values(docs)["KVMESH_GRACE_SECONDS"])
    for dep_name, dep in _kind(docs, "Deployment").items():
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
        spec = dep["spec"]["template"]["spec"]
        # A pod restarts whatever exits (kvmesh services re-attach to a restarted dependency).
        assert spec.get("restartPolicy", "Always") == "Always", dep_name
        for c in spec["containers"]:
            sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            # The drain: grace, then up to 3 s to end the remaining streams and close.
            assert sleep + grace + 3 < spec["terminationGracePeriodSeconds"], dep_name
    (pdb,) = _kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["maxUnavailable"] == 1
    for _name2, meta, _spec in _pod_specs(docs):
        assert _selects(pdb["spec"]["selector"], meta["labels"])


def test_deployment_key_comes_from_a_secret(overlay: tuple[str, str, list[Doc]]) -> None:
    _name, _text, docs = overlay
    secrets = _kind(docs, "Secret")
    spec = _kind(docs, "Deployment")["kv-cache-manager"]["spec"]["template"]["spec"]
    refs = [s["secretRef"]["name"] for s in spec["containers"][0]["envFrom"] if "secretRef" in s]
    assert refs and all(r in secrets for r in refs)
    assert "KVMESH_KVM_DEPLOYMENT_KEY" not in _values(docs)


def test_overlay_specific_settings(overlay: tuple[str, str, list[Doc]]) -> None:
    name, _text, docs = overlay
    values = _values(docs)
    spec = _kind(docs, "Deployment")["model-runner"]["spec"]["template"]["spec"]
    runner, store = spec["containers"]
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in spec["containers"]]
    if name == "cpu":
        assert values["KVMESH_RUNNER_DEVICE"] == "cpu"
        assert values["KVMESH_RUNNER_ATTENTION_BACKEND"] == "auto"
        assert gpus == [None, None]
        assert "nodeSelector" not in spec
        assert runner["image"] == "kvmesh:0.1.0"
    else:
        assert values["KVMESH_RUNNER_DEVICE"] == "cuda"
        assert values["KVMESH_RUNNER_ATTENTION_BACKEND"] == "triton"
        assert gpus == [1, None]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert _env(store)["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert runner["image"] == "kvmesh:0.1.0-cuda"
        cache = next(v for v in spec["volumes"] if v["name"] == "model-cache")
        assert set(cache) == {"name", "persistentVolumeClaim"}
        assert cache["persistentVolumeClaim"]["claimName"] in _kind(docs, "PersistentVolumeClaim")


def test_mutual_tls_and_api_keys_are_on(overlay: tuple[str, str, list[Doc]]) -> None:
    """Every service serves TLS from its own certificate Secret; internal ones admit only the
    scheduler's certificate; the scheduler checks API keys from a mounted Secret (docs/security.md)."""
    _name, _text, docs = overlay
    values = _values(docs)
    tls_dir = "/etc/kvmesh/tls"
    assert (values["KVMESH_TLS_CERT"], values["KVMESH_TLS_KEY"], values["KVMESH_TLS_CA"]) == (
        f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key", f"{tls_dir}/ca.crt")
    secrets_by_pod = {}
    for dep, _meta, spec in _pod_specs(docs):
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            tls = volumes[mounts[tls_dir]["name"]]
            assert mounts[tls_dir]["readOnly"] is True
            secrets_by_pod.setdefault(dep, set()).add(tls["secret"]["secretName"])
            env = _env(c)
            if c["name"] == "gateway":
                assert "KVMESH_TLS_ALLOWED_PEERS" not in env  # public HTTP; it only dials the scheduler
            elif c["name"] == "scheduler":
                assert "KVMESH_TLS_ALLOWED_PEERS" not in env  # the public port: API keys, not certificates
                assert env["KVMESH_AUTH_MODE"] == "on"
                keys_dir = str(Path(env["KVMESH_AUTH_KEYS_FILE"]).parent)
                assert volumes[mounts[keys_dir]["name"]]["secret"]["secretName"] == "kvmesh-api-keys"
            else:
                assert env["KVMESH_TLS_ALLOWED_PEERS"] == "scheduler"
    assert secrets_by_pod == {dep: {f"kvmesh-tls-{dep}"}
                              for dep in ("scheduler", "kv-cache-manager", "model-runner", "gateway")}
