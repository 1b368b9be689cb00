"""Entry point of ``kvmesh serve scheduler``: the only place that reads the environment.

Variables: ``KVMESH_SCHED_*`` (fields of :class:`SchedulerConfig`, e.g. ``KVMESH_SCHED_KVM_ADDRESS``),
``KVMESH_MODEL_DIR`` (tokenizer folder), ``KVMESH_HOST`` / ``KVMESH_PORT`` / ``KVMESH_PORT_FILE``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid

from services.kv_cache_manager.client import RemoteKVCache
from services.model_runner.client import RemoteRunner
from services.offload_store.client import RemoteOffload
from services.scheduler.auth import AuthInterceptor, key_store_for
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.readiness import DependencyWatcher
from services.scheduler.servicer import SERVICE, SchedulerServicer
from services.scheduler.shutdown import drain_engine
from services.scheduler.tokenizer import Tokenizer
from shared.auth import AuthConfig
from shared.channels import configure as configure_channels
from shared.config import ServerConfig, from_env
from shared.grpc_server import ServiceRegistration, serve_forever, start_server
from shared.launcher import HealthProbe, wait_healthy
from shared.metrics import metrics_config, new_registry, start_metrics_server
from shared.pb.kvmesh.v1 import scheduler_pb2_grpc
from shared.telemetry import server_interceptors, setup_tracing
from shared.tls import TLSFiles

log = logging.getLogger(__name__)


def main() -> int:
    """Connects to the kv-cache-manager and model-runner, then serves the public API."""
    env = os.environ
    setup_tracing(SERVICE.label, env)
    registry = new_registry()
    config = from_env(SchedulerConfig, "KVMESH_SCHED_", model_dir=env.get("KVMESH_MODEL_DIR", ""))
    if env.get("KVMESH_DEPLOYMENT_KEY"):  # the prefix-hash key: only the scheduler reads it (it hashes)
        config = dataclasses.replace(config, deployment_key=env["KVMESH_DEPLOYMENT_KEY"])
    # NOTE: every streaming Generate holds a server thread for its whole life, so the pool must
    # exceed the admission bound; otherwise excess requests queue inside gRPC, invisible to
    # admission control, instead of getting RESOURCE_EXHAUSTED at once.
    workers = config.max_waiting_requests + config.max_num_seqs + 16
    # The public API takes smaller messages than the internal services: its longest legitimate
    # request is a prompt bounded by max_model_len x max_bytes_per_token.
    receive = int(env.get("KVMESH_MAX_RECEIVE_MESSAGE_BYTES", 8 << 20))
    server_cfg = from_env(ServerConfig, "KVMESH_", max_workers=int(env.get("KVMESH_MAX_WORKERS", workers)),
                          max_receive_message_bytes=receive)
    if "KVMESH_TLS_CLIENT_AUTH" not in env:  # the public port: clients present API keys, not certificates
        server_cfg = dataclasses.replace(server_cfg, tls_client_auth=False)
    configure_channels(from_env(TLSFiles, "KVMESH_TLS_"))  # our certificate when dialing the services
    keys = key_store_for(from_env(AuthConfig, "KVMESH_AUTH_"), server_cfg.host)
    for address in (config.kvm_address, config.runner_address):
        wait_healthy(address, timeout=float(env.get("KVMESH_DEPENDENCY_TIMEOUT", "300")))
    owner_id = uuid.uuid4().hex  # this scheduler incarnation (docs/reliability.md)
    kv = RemoteKVCache(config.kvm_address, config.rpc_timeout_seconds, owner_id, config.owner_lease_seconds)
    runner = RemoteRunner(config.runner_address, config.rpc_timeout_seconds)
    offload = None
    if config.offload_address:
        wait_healthy(config.offload_address, timeout=float(env.get("KVMESH_DEPENDENCY_TIMEOUT", "300")))
        offload = RemoteOffload(config.offload_address, config.rpc_timeout_seconds, owner_id,
                                config.owner_lease_seconds)
    tokenizer = Tokenizer(config.model_dir) if config.model_dir else None
    mcfg = metrics_config(env, server_cfg.host)
    metrics = SchedulerMetrics(registry, mcfg.model_name, runner.info().max_model_len)
    start_metrics_server(mcfg.port, registry, addr=mcfg.host)
    engine = Engine(config, kv, runner, offload, metrics)  # binds the suite (waits out a dead predecessor's lease)
    engine.start()
    servicer = SchedulerServicer(engine, tokenizer)
    running = start_server(server_cfg, [
        ServiceRegistration(SERVICE.grpc, servicer, scheduler_pb2_grpc.add_SchedulerServicer_to_server),
    ], interceptors=[*server_interceptors(), AuthInterceptor(keys)])
    deps = {"kv-cache-manager": config.kvm_address, "model-runner": config.runner_address}
    if config.offload_address:
        deps["offload-store"] = config.offload_address
    probes = {name: HealthProbe(address, config.dependency_check_seconds) for name, address in deps.items()}
    watcher = DependencyWatcher(probes, ("kv-cache-manager", "model-runner"), running.set_serving,
                                running.set_status, config.dependency_check_seconds).start()
    try:
        serve_forever(running, SERVICE.label, drain=lambda grace: drain_engine(engine, grace))
    finally:
        watcher.stop()
        for probe in probes.values():
            probe.close()
        engine.stop()
        _release(kv, offload)
        kv.close()
        runner.close()
        if offload is not None:
            offload.close()
    return 0


def _release(kv: RemoteKVCache, offload: RemoteOffload | None) -> None:
    """Clean exit: hand ownership back so a successor binds at once (its requests are freed)."""
    for name, peer in (("kv-cache-manager", kv), ("offload-store", offload)):
        if peer is None:
            continue
        try:
            peer.release()
        except Exception as exc:  # a dead peer has nothing to release
            log.warning("releasing the %s failed: %s", name, exc)
