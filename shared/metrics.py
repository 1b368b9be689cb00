"""What every service's Prometheus metrics share: the registry, the naming, the endpoint.

Each service owns its metric group in its own ``metrics.py`` (``SchedulerMetrics``,
``KVCacheMetrics``, ``RunnerMetrics``, ``RouterMetrics``, ``OffloadMetrics``); this module holds
only what they have in common::

    registry = new_registry()
    metrics = SchedulerMetrics(registry, model_name="SmolLM2-135M-Instruct")
    start_metrics_server(port, registry, addr=host)     # port 0 = no HTTP endpoint

Every metric is named after vLLM's (so existing dashboards read them), defined exactly once, in one
group, and carries a ``model_name`` label (vLLM's convention) so several models can share one
Prometheus. A private registry per process (instead of prometheus_client's global one) keeps tests
independent and exposes only kvmesh's metrics plus the standard process/platform/GC collectors.

Units follow Prometheus practice: seconds, tokens, blocks, bytes; ``*_perc`` is a fraction in
[0, 1] as in vLLM (``kvmesh:kv_cache_usage_perc 1.0`` means 100 %).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from shared.errors import PortInUseError

PREFIX = "kvmesh:"
MODEL_LABEL = "model_name"


def token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 buckets up to ``max_model_len`` tokens (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


def new_registry(process_collectors: bool = True) -> CollectorRegistry:
    """A private registry for one process, with the standard process/platform/GC collectors.

    Args:
        process_collectors: add CPU, memory, file descriptor, Python and GC metrics (what the
            default registry would show); tests may leave them out.
    """
    registry = CollectorRegistry(auto_describe=True)
    if process_collectors:
        # NOTE: the library's module-level collectors belong to its global registry; fresh
        # instances register into ours instead.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


@dataclass(frozen=True)
class MetricsConfig:
    """Where a service exposes ``/metrics`` and the ``model_name`` label it uses.

    Attributes:
        port: ``KVMESH_METRICS_PORT``; 0 = no endpoint.
        host: ``KVMESH_METRICS_HOST``, else the service's own ``KVMESH_HOST`` (so a suite on
            loopback does not expose metrics on every interface).
        model_name: ``KVMESH_MODEL_NAME``, else the folder name of ``KVMESH_MODEL_DIR`` (the
            model-runner's default ``model_id``). Every service derives it the same way from the
            same variables, so one deployment has one label value on every series.
    """

    port: int = 0
    host: str = "127.0.0.1"
    model_name: str = "default"


def metrics_config(env: Mapping[str, str], server_host: str) -> MetricsConfig:
    """Reads :class:`MetricsConfig` from ``env`` (called from a service's ``main.py`` only)."""
    name = env.get("KVMESH_MODEL_NAME") or PurePath(env.get("KVMESH_MODEL_DIR", "").rstrip("/")).name
    return MetricsConfig(port=int(env.get("KVMESH_METRICS_PORT", "0") or 0),
                         host=env.get("KVMESH_METRICS_HOST") or server_host, model_name=name or "default")


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> WSGIServer | None:
    """Serves ``registry`` at ``http://addr:port/metrics`` from a daemon thread.

    Args:
        port: TCP port (``KVMESH_METRICS_PORT``); 0 disables the endpoint and returns None.
        registry: what to expose.
        addr: bind address; containers need ``0.0.0.0`` so Prometheus can reach it.

    Returns:
        The running server (``.server_port``, ``.shutdown()``), or None when disabled.

    Raises:
        PortInUseError: ``port`` is taken.
    """
    if port == 0:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"metrics port out of range: {port}")
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:  # one line at start, as a taken gRPC port gives
            raise PortInUseError(f"metrics port {port} on {addr} is already in use") from None
        raise
    return server
