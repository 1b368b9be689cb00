"""Entry point of ``kvmesh serve gateway``: the only place that reads the environment.

Variables: ``KVMESH_GATEWAY_*`` (fields of :class:`GatewayConfig`, e.g.
``KVMESH_GATEWAY_SCHEDULER_ADDRESS``), ``KVMESH_HOST`` / ``KVMESH_PORT`` / ``KVMESH_PORT_FILE``
(where the HTTP API listens; port 0 picks a free one and writes it to the port file),
``KVMESH_MODEL_NAME`` / ``KVMESH_MODEL_DIR`` (the ``model_name`` label of ``/metrics``),
``KVMESH_TLS_CERT`` / ``_KEY`` / ``_CA`` / ``_SERVER_NAME`` (how to dial the scheduler).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import uvicorn

from services.gateway.app import create_app
from services.gateway.client import SchedulerClient
from services.gateway.config import GatewayConfig
from services.gateway.core import Gateway
from shared.config import ServerConfig, from_env
from shared.metrics import metrics_config, new_registry
from shared.tls import TLSFiles

log = logging.getLogger(__name__)


def main() -> int:
    """Binds the HTTP port, reports it, and serves until SIGTERM (uvicorn drains open requests)."""
    env = os.environ
    config = from_env(GatewayConfig, "KVMESH_GATEWAY_", env)
    server_cfg = from_env(ServerConfig, "KVMESH_", env)
    # TLS to the scheduler when KVMESH_TLS_* name files (the scheduler's public port wants no client cert).
    client = SchedulerClient(config.scheduler_address, from_env(TLSFiles, "KVMESH_TLS_", env))
    model_label = metrics_config(env, server_cfg.host).model_name
    app = create_app(Gateway(config, client), new_registry(), model_label, on_shutdown=client.close)
    # NOTE: the socket is bound here (not by uvicorn) so port 0 can be reported before serving;
    # connections arriving in between wait in the listen backlog.
    family = socket.AF_INET6 if ":" in server_cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((server_cfg.host, server_cfg.port))
    sock.listen(2048)
    port = sock.getsockname()[1]
    if server_cfg.port_file:
        Path(server_cfg.port_file).write_text(str(port))
    log.info("gateway serving on http://%s:%d (scheduler %s)", server_cfg.host, port, config.scheduler_address)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=int(server_cfg.grace_seconds)))
    asyncio.run(server.serve(sockets=[sock]))
    return 0
