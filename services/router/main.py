"""Entry point of ``kvmesh serve router``: the only place that reads the router's environment.

Variables: ``KVMESH_ROUTER_*`` (fields of :class:`RouterConfig`, e.g. ``KVMESH_ROUTER_REPLICAS``,
``KVMESH_ROUTER_POLICY``), ``KVMESH_DEPLOYMENT_KEY`` (the replicas' key: hash seed and tenant
salt), ``KVMESH_MODEL_DIR`` (tokenizer), ``KVMESH_AUTH_*`` (the same keys file as the replicas:
the router needs the tenant to salt the hashes), ``KVMESH_HOST`` / ``KVMESH_PORT`` /
``KVMESH_PORT_FILE``, ``KVMESH_METRICS_PORT``.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from services.router.client import ReplicaSet
from services.router.config import RouterConfig
from services.router.index import PrefixIndex
from services.router.metrics import RouterMetrics
from services.router.offload_index import OffloadIndex
from services.router.routing import Router
from services.router.servicer import PUBLIC_API, SERVICE, RouterFront, RouterSchedulerServicer, RouterServicer
from services.scheduler.auth import AuthInterceptor, key_store_for
from services.scheduler.tokenizer import Tokenizer
from shared.auth import AuthConfig
from shared.channels import configure as configure_channels
from shared.config import ServerConfig, from_env
from shared.grpc_server import ServiceRegistration, serve_forever, start_server
from shared.metrics import metrics_config, new_registry, start_metrics_server
from shared.pb.kvmesh.v1 import router_pb2_grpc, scheduler_pb2_grpc
from shared.telemetry import server_interceptors, setup_tracing
from shared.tls import TLSFiles

log = logging.getLogger(__name__)


def main() -> int:
    """Connects to every replica (waiting a bounded time), then serves the public API."""
    env = os.environ
    setup_tracing(SERVICE.label, env)
    registry = new_registry()
    config = from_env(RouterConfig, "KVMESH_ROUTER_", model_dir=env.get("KVMESH_MODEL_DIR", ""))
    if env.get("KVMESH_DEPLOYMENT_KEY"):  # the replicas' key (one secret for the whole mesh)
        config = dataclasses.replace(config, deployment_key=env["KVMESH_DEPLOYMENT_KEY"])
    if not config.replica_addresses() and not config.discovery_name:
        raise SystemExit("router: set KVMESH_ROUTER_REPLICAS (id=scheduler/kv_cache_manager,...) "
                         "or KVMESH_ROUTER_DISCOVERY_NAME (a headless Service)")
    server_cfg = from_env(ServerConfig, "KVMESH_", max_workers=int(env.get("KVMESH_MAX_WORKERS", "256")))
    if "KVMESH_TLS_CLIENT_AUTH" not in env:  # the public port: clients present API keys, not certificates
        server_cfg = dataclasses.replace(server_cfg, tls_client_auth=False)
    configure_channels(from_env(TLSFiles, "KVMESH_TLS_"))
    keys = key_store_for(from_env(AuthConfig, "KVMESH_AUTH_"), server_cfg.host)
    metrics = RouterMetrics(registry)
    index = PrefixIndex()
    offload = OffloadIndex()
    replicas = ReplicaSet(config, index, metrics, offload=offload)
    replicas.start()
    if not replicas.wait_ready(config.ready_timeout_seconds):
        log.warning("router: serving before every replica is up: %s",
                    ", ".join(f"{r.id} healthy={r.healthy} subscribed={r.subscribed}" for r in replicas.replicas))
    tokenizer = Tokenizer(config.model_dir) if config.model_dir else None
    front = RouterFront(replicas, Router(config, index, metrics, offload), tokenizer)
    mcfg = metrics_config(env, server_cfg.host)  # bound to KVMESH_HOST like every service's
    start_metrics_server(mcfg.port, registry, addr=mcfg.host)
    running = start_server(server_cfg, [
        ServiceRegistration(PUBLIC_API.grpc, RouterSchedulerServicer(front),
                            scheduler_pb2_grpc.add_SchedulerServicer_to_server),
        ServiceRegistration(SERVICE.grpc, RouterServicer(front), router_pb2_grpc.add_RouterServicer_to_server),
    ], interceptors=[*server_interceptors(), AuthInterceptor(keys)])
    log.info("router: %d replicas%s, policy %s, tokenizer %s", len(replicas.replicas),
             f" (discovered through {config.discovery_name})" if config.discovery_name else "", config.policy,
             config.model_dir or "(the replicas' Tokenize)")
    try:
        serve_forever(running, SERVICE.label)
    finally:
        replicas.close()
    return 0
