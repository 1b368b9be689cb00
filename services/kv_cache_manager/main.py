"""Entry point of ``kvmesh serve kv-cache-manager``: the only place that reads the environment.

The manager starts unbound: geometry and hash seed arrive from the scheduler in ``Initialize``
(one owner each, see docs/reliability.md), so nothing about the pool is read here.

Environment:
    KVMESH_MODEL_ID: the model label of the Prometheus metrics (optional).
    KVMESH_HOST, KVMESH_PORT, KVMESH_PORT_FILE (and KVMESH_MAX_WORKERS,
    KVMESH_GRACE_SECONDS): :class:`shared.config.ServerConfig`.
"""

from __future__ import annotations

import logging
import os

from services.kv_cache_manager.binding import ManagerBinding
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.metrics import KVCacheMetrics
from services.kv_cache_manager.servicer import SERVICE, KVCacheManagerServicer
from shared.config import ServerConfig, from_env
from shared.grpc_server import ServiceRegistration, serve_forever, start_server
from shared.metrics import metrics_config, new_registry, start_metrics_server
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from shared.telemetry import server_interceptors, setup_tracing

log = logging.getLogger(__name__)


def main() -> int:
    """Reads the configuration, serves until a signal, returns the exit code."""
    setup_tracing(SERVICE.label, os.environ)
    registry = new_registry()
    server_config = from_env(ServerConfig, "KVMESH_")
    mcfg = metrics_config(os.environ, server_config.host)
    hub = EventHub()
    # A quarter of the workers at most may be held by (endless) event streams.
    binding = ManagerBinding(hub)
    servicer = KVCacheManagerServicer(binding, hub, max_subscribers=max(1, server_config.max_workers // 4),
                                      metrics=KVCacheMetrics(registry, mcfg.model_name))
    # Metrics first, as every service: a taken metrics port then fails the start before the gRPC
    # port is reported, so a launcher never waits on a server that is about to exit.
    start_metrics_server(mcfg.port, registry, addr=mcfg.host)
    running = start_server(server_config, [
        ServiceRegistration(SERVICE.grpc, servicer, pb_grpc.add_KVCacheManagerServicer_to_server),
    ], interceptors=server_interceptors())
    log.info("%s: instance %s up, waiting for a scheduler's Initialize", SERVICE.label, binding.instance_id)
    serve_forever(running, SERVICE.label, on_stop=servicer.close)
    return 0
