"""Entry point of ``kvmesh serve kv-cache-manager``: the only place that reads the environment.

Environment:
    KVMESH_KVM_BLOCK_SIZE, KVMESH_KVM_NUM_BLOCKS, KVMESH_KVM_MAX_MODEL_LEN, KVMESH_KVM_MODEL_ID,
    KVMESH_KVM_DEPLOYMENT_KEY: :class:`shared.config.CacheConfig`; KVMESH_DEPLOYMENT_KEY, when set,
    overrides the key (the scheduler reads the same variable).
    KVMESH_HOST, KVMESH_PORT, KVMESH_PORT_FILE (and KVMESH_MAX_WORKERS,
    KVMESH_GRACE_SECONDS): :class:`shared.config.ServerConfig`.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.servicer import SERVICE_NAME, KVCacheManagerServicer
from shared.config import CacheConfig, ServerConfig, from_env
from shared.grpc_server import ServiceRegistration, serve_forever, start_server
from shared.metrics import KVCacheMetrics, metrics_config, new_registry, start_metrics_server
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from shared.telemetry import server_interceptors, setup_tracing

log = logging.getLogger(__name__)
LABEL = "kv-cache-manager"


def main() -> int:
    """Reads the configuration, serves until a signal, returns the exit code."""
    setup_tracing(LABEL, os.environ)
    registry = new_registry()
    cache_config = from_env(CacheConfig, "KVMESH_KVM_")
    if os.environ.get("KVMESH_DEPLOYMENT_KEY"):  # the key the scheduler reads too (one secret for both)
        cache_config = dataclasses.replace(cache_config, deployment_key=os.environ["KVMESH_DEPLOYMENT_KEY"])
    server_config = from_env(ServerConfig, "KVMESH_")
    mcfg = metrics_config(os.environ, server_config.host)
    hub = EventHub()
    # A quarter of the workers at most may be held by (endless) event streams.
    servicer = KVCacheManagerServicer(KVCacheManager(cache_config, hub), hub,
                                      max_subscribers=max(1, server_config.max_workers // 4),
                                      metrics=KVCacheMetrics(registry, mcfg.model_name))
    running = start_server(server_config, [
        ServiceRegistration(SERVICE_NAME, servicer, pb_grpc.add_KVCacheManagerServicer_to_server),
    ], interceptors=server_interceptors())
    start_metrics_server(mcfg.port, registry, addr=mcfg.host)
    log.info("%s: %d blocks of %d tokens, max_model_len %d, model %r", LABEL, cache_config.num_blocks,
             cache_config.block_size, cache_config.max_model_len, cache_config.model_id)
    serve_forever(running, LABEL, on_stop=servicer.close)
    return 0
