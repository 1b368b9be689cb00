"""Entry point of ``kvmesh serve model-runner``: the only place that reads the environment.

Variables: ``KVMESH_RUNNER_*`` (fields of :class:`RunnerConfig`, e.g. ``KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES``),
``KVMESH_MODEL_DIR`` (the checkpoint folder), ``KVMESH_HOST`` / ``KVMESH_PORT`` / ``KVMESH_PORT_FILE``.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner
from services.model_runner.metrics import RunnerMetrics
from services.model_runner.servicer import SERVICE, ModelRunnerServicer
from shared.config import ServerConfig, from_env
from shared.grpc_server import ServiceRegistration, serve_forever, start_server
from shared.metrics import metrics_config, new_registry, start_metrics_server
from shared.pb.kvmesh.v1 import model_runner_pb2_grpc
from shared.telemetry import server_interceptors, setup_tracing

log = logging.getLogger(__name__)


def main() -> int:
    """Loads the model and the pool, then serves until SIGTERM; the pool file is removed on exit."""
    env = os.environ
    setup_tracing(SERVICE.label, env)
    registry = new_registry()
    config = from_env(RunnerConfig, "KVMESH_RUNNER_")
    if env.get("KVMESH_MODEL_DIR"):
        config = dataclasses.replace(config, model_dir=env["KVMESH_MODEL_DIR"])
    if not config.model_dir:
        raise SystemExit("model-runner: set KVMESH_MODEL_DIR (or KVMESH_RUNNER_MODEL_DIR) to a checkpoint folder")
    core = build_runner(config)
    info = core.model_info()
    log.info("model %s: %d blocks of %d tokens (%s weights: %s; %s KV; %s attention: %s; %s)", info.model_id,
             info.num_blocks, info.block_size, info.dtype, info.dtype_reason, info.kv_cache_dtype,
             info.attention_backend, info.attention_backend_reason, info.device)
    server_cfg = from_env(ServerConfig, "KVMESH_")
    mcfg = metrics_config(env, server_cfg.host)
    metrics = RunnerMetrics(registry, mcfg.model_name)
    start_metrics_server(mcfg.port, registry, addr=mcfg.host)
    running = start_server(server_cfg, [
        ServiceRegistration(SERVICE.grpc, ModelRunnerServicer(core, metrics),
                            model_runner_pb2_grpc.add_ModelRunnerServicer_to_server),
    ], interceptors=server_interceptors())
    try:
        serve_forever(running, SERVICE.label)
    finally:
        core.pool.close()
    return 0
