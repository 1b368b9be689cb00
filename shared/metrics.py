"""Prometheus metrics of every kvmesh service, named after vLLM's so existing dashboards read them.

Each service creates one registry and the one metric group it owns, then serves it::

    registry = new_registry()
    metrics = SchedulerMetrics(registry, model_name="SmolLM2-135M-Instruct")
    start_metrics_server(port, registry, addr=host)     # port 0 = no HTTP endpoint

Every metric is defined exactly once, in one group, and carries a ``model_name`` label (vLLM's
convention) so several models can share one Prometheus. A private registry per process (instead
of prometheus_client's global one) keeps tests independent and exposes only kvmesh's metrics plus
the standard process/platform/GC collectors.

| service          | group              | metrics                                                        |
|------------------|--------------------|----------------------------------------------------------------|
| scheduler        | SchedulerMetrics   | running/waiting requests, preemptions, TTFT, TPOT, ITL, e2e,   |
|                  |                    | queue time, prompt/generation tokens (histograms and counters),|
|                  |                    | finished requests by reason                                    |
| kv-cache-manager | KVCacheMetrics     | KV cache usage (fraction), prefix cache queries/hits in tokens |
| model-runner     | RunnerMetrics      | forward time per step, tokens per step                         |
| offload-store    | OffloadMetrics     | (in ``services/offload_store/metrics.py``)                     |

Units follow Prometheus practice: seconds, tokens, blocks, bytes; ``*_perc`` is a fraction in
[0, 1] as in vLLM (``kvmesh:kv_cache_usage_perc 1.0`` means 100 %).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

PREFIX = "kvmesh:"
MODEL_LABEL = "model_name"
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Buckets as in vLLM (seconds), wide enough for a CPU-only deployment's slow steps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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


class SchedulerMetrics:
    """Request-level metrics: what a user waits for, and how full the queues are.

    Args:
        registry: the process's registry (:func:`new_registry`).
        model_name: value of the ``model_name`` label.
        max_model_len: upper end of the token-count histograms.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int = 2048) -> None:
        labels = [MODEL_LABEL]
        tokens = token_buckets(max_model_len)
        self._model = model_name
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests in the running batch (holding KV blocks).",
            labels, registry=registry).labels(model_name)
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests admitted but waiting to be scheduled.",
            labels, registry=registry).labels(model_name)
        self.num_preemptions = Counter(
            PREFIX + "num_preemptions", "Running requests preempted for lack of KV blocks.",
            labels, registry=registry).labels(model_name)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed (prefill), for throughput.",
            labels, registry=registry).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated (decode), for throughput.",
            labels, registry=registry).labels(model_name)
        self._request_success = Counter(
            PREFIX + "request_success", "Finished requests by reason (stop, length, abort, error).",
            [MODEL_LABEL, "finished_reason"], registry=registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.",
            labels, buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.time_per_output_token = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per request: (e2e - TTFT) / (generated tokens - 1), i.e. mean TPOT.",
            labels, buckets=TPOT_BUCKETS, registry=registry).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between two consecutive streamed tokens.",
            labels, buckets=TPOT_BUCKETS, registry=registry).labels(model_name)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to the last token (or the error).",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first being scheduled.",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        # vLLM's phases of a request: queue, then prefill (first scheduled -> first token), then
        # decode (first token -> last token); queue + prefill + decode = e2e.
        self.request_prefill_time = Histogram(
            PREFIX + "request_prefill_time_seconds", "First scheduled to first token (prompt read).",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.request_decode_time = Histogram(
            PREFIX + "request_decode_time_seconds", "First token to last token.",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt length per finished request.",
            labels, buckets=tokens, registry=registry).labels(model_name)
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Generated tokens per finished request.",
            labels, buckets=tokens, registry=registry).labels(model_name)

    def set_queues(self, running: int, waiting: int) -> None:
        """Called once per scheduler step with the queue lengths after scheduling."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)

    def add_step_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Tokens a step computed; counted per step so throughput panels move while requests run."""
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)

    def observe_finished(self, *, finished_reason: str, e2e_s: float, queue_s: float | None,
                         ttft_s: float | None, prompt_tokens: int, generation_tokens: int) -> None:
        """Records a finished request; TPOT is derived here so every caller computes it the same way.

        Args:
            finished_reason: one of :data:`FINISHED_REASONS`.
            e2e_s: arrival to the last token or the error.
            queue_s: arrival to first scheduled, None if never scheduled.
            ttft_s: arrival to first token, None if no token was produced (it is then not
                observed, so failures do not pull TTFT percentiles down).
            prompt_tokens: prompt length.
            generation_tokens: tokens produced.
        """
        if finished_reason not in FINISHED_REASONS:
            raise ValueError(f"finished_reason must be one of {FINISHED_REASONS}, not {finished_reason!r}")
        self._request_success.labels(self._model, finished_reason).inc()
        self.e2e_request_latency.observe(e2e_s)
        if queue_s is not None:
            self.request_queue_time.observe(queue_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
            if queue_s is not None:
                self.request_prefill_time.observe(max(ttft_s - queue_s, 0.0))
            self.request_decode_time.observe(max(e2e_s - ttft_s, 0.0))
            if generation_tokens > 1:
                self.time_per_output_token.observe((e2e_s - ttft_s) / (generation_tokens - 1))

    def observe_inter_token(self, seconds: Sequence[float] | float) -> None:
        """Gaps between consecutive tokens of a request, observed as they stream."""
        for value in [seconds] if isinstance(seconds, int | float) else seconds:
            self.inter_token_latency.observe(value)


class KVCacheMetrics:
    """Block pool occupancy and prefix cache effectiveness (the kv-cache-manager's view).

    Hit rate = ``rate(kvmesh:prefix_cache_hits_total) / rate(kvmesh:prefix_cache_queries_total)``,
    both in tokens as in vLLM, so long and short prompts weigh by what they save.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = [MODEL_LABEL]
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of KV blocks in use by requests (1 = 100%); cached free blocks count as free.",
            labels, registry=registry).labels(model_name)
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            labels, registry=registry).labels(model_name)
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache (KV not recomputed).",
            labels, registry=registry).labels(model_name)

    def set_usage(self, used_blocks: int, usable_blocks: int) -> None:
        """Pool occupancy; ``usable_blocks`` excludes the null block 0."""
        self.kv_cache_usage_perc.set(used_blocks / usable_blocks if usable_blocks > 0 else 0.0)

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """One prefix lookup: tokens asked about and tokens served from cache."""
        if hit_tokens > queried_tokens:
            raise ValueError("hit_tokens cannot exceed queried_tokens")
        self.prefix_cache_queries.inc(queried_tokens)
        self.prefix_cache_hits.inc(hit_tokens)


class RunnerMetrics:
    """Per-step cost of the model (the model-runner's view)."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 max_num_batched_tokens: int = 8192) -> None:
        labels = [MODEL_LABEL]
        self.model_forward_time = Histogram(
            PREFIX + "model_forward_time_seconds", "Execute(): KV writes, attention, sampling of one step.",
            labels, buckets=STEP_BUCKETS, registry=registry).labels(model_name)
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total", "Tokens computed per step (prefill chunks + decodes).",
            labels, buckets=token_buckets(max_num_batched_tokens), registry=registry).labels(model_name)

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        """One Execute() call."""
        self.model_forward_time.observe(seconds)
        self.iteration_tokens.observe(num_tokens)


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
    """
    if port == 0:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"metrics port out of range: {port}")
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
