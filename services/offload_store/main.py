"""``kvmesh serve offload-store``: the only place that reads the environment.

Variables: ``KVMESH_OFFLOAD_DATA_DIR``, ``KVMESH_OFFLOAD_DB_URL`` (default: SQLite in the data
dir), ``KVMESH_OFFLOAD_DB_TABLE``, ``KVMESH_OFFLOAD_DRAM_BYTES``, ``KVMESH_OFFLOAD_DISK_BYTES``,
``KVMESH_OFFLOAD_POOL_DIR``, ``KVMESH_OFFLOAD_TORCH_THREADS``, the remote tier's
``KVMESH_OFFLOAD_REMOTE_URL`` (empty: off), ``..._REMOTE_TIMEOUT_SECONDS``, ``..._REMOTE_KEY_PREFIX``,
``..._REMOTE_TTL_SECONDS``, ``..._REMOTE_RETRY_SECONDS``, ``..._REMOTE_BATCH_BYTES``, and the
server's ``KVMESH_HOST`` / ``KVMESH_PORT`` / ``KVMESH_PORT_FILE``.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlsplit

import torch

from services.offload_store.config import OffloadConfig
from services.offload_store.metrics import OffloadMetrics
from services.offload_store.remote_metrics import RemoteTierCollector
from services.offload_store.servicer import SERVICE, OffloadStoreServicer
from services.offload_store.store import OffloadStore
from shared.config import ServerConfig, from_env
from shared.grpc_server import ServiceRegistration, serve_forever, start_server
from shared.metrics import metrics_config, new_registry, start_metrics_server
from shared.pb.kvmesh.v1 import offload_store_pb2_grpc
from shared.telemetry import server_interceptors, setup_tracing

log = logging.getLogger(__name__)


def main() -> int:
    """Opens the store (reconciling disk and index), serves until SIGTERM, then closes it."""
    setup_tracing(SERVICE.label, os.environ)
    registry = new_registry()
    config = from_env(OffloadConfig, "KVMESH_OFFLOAD_")
    server_config = from_env(ServerConfig, "KVMESH_")
    mcfg = metrics_config(os.environ, server_config.host)
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    core = OffloadStore(config)
    log.info("%s: data dir %s, reconcile %s", SERVICE.label, config.data_dir, core.reconcile_report)
    if core.remote is not None:
        registry.register(RemoteTierCollector(core.remote, mcfg.model_name))
        # NOTE: the host only: the URL may carry a password
        log.info("%s: remote tier at %s, keys %s*", SERVICE.label, urlsplit(config.remote_url).hostname,
                 config.remote_key_prefix)
    try:
        registration = ServiceRegistration(
            SERVICE.grpc, OffloadStoreServicer(core, OffloadMetrics(registry, mcfg.model_name),
                                               max_subscribers=config.max_subscribers),
            offload_store_pb2_grpc.add_OffloadStoreServicer_to_server,
        )
        start_metrics_server(mcfg.port, registry, addr=mcfg.host)  # first: see kv_cache_manager/main.py
        running = start_server(server_config, [registration], interceptors=server_interceptors())
        serve_forever(running, SERVICE.label)
    finally:
        core.hub.close()  # open event streams end cleanly
        core.close()
    return 0
