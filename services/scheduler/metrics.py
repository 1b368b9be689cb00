"""The scheduler's metrics: per-request latency figures and their Prometheus series.

TTFT = first token - arrival; TPOT = (last token - first token) / (output tokens - 1);
ITL = gaps between successive tokens (the largest is kept per request); queue = first
scheduling - arrival. Derived in one place (:func:`request_metrics`), sent in each stream's final
chunk and observed into :class:`SchedulerMetrics` (named after vLLM's, so its dashboards read them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.request import Request
from services.scheduler.types import RequestMetrics
from shared.metrics import MODEL_LABEL, PREFIX, token_buckets

FINISHED_REASONS = ("stop", "length", "abort", "error")
# Buckets as in vLLM (seconds), wide enough for a CPU-only deployment's slow steps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def request_metrics(req: Request, completion_tokens: int | None = None, now: float | None = None) -> RequestMetrics:
    """Metrics of ``req`` as it stands (``completion_tokens`` overrides the count, e.g. after a
    stop string truncated the output)."""
    t = req.times
    now = time.monotonic() if now is None else now
    n = len(req.output_token_ids) if completion_tokens is None else completion_tokens
    first = t.first_token
    last = t.last_token if t.last_token is not None else now
    return RequestMetrics(
        prompt_tokens=req.num_prompt_tokens,
        completion_tokens=n,
        cached_tokens=max(req.num_cached_tokens, 0),
        preemptions=req.num_preemptions,
        queue_seconds=(t.first_scheduled - t.arrival) if t.first_scheduled is not None else now - t.arrival,
        ttft_seconds=(first - t.arrival) if first is not None else 0.0,
        tpot_seconds=((last - first) / (n - 1)) if first is not None and n > 1 else 0.0,
        e2e_seconds=last - t.arrival,
        max_itl_seconds=t.max_itl,
    )


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
        self._steps = Counter(
            PREFIX + "steps", "Steps run, by how they were planned: synchronous (after the step before "
            "returned) or ahead (async scheduling: sent while the step before ran).",
            [MODEL_LABEL, "planned"], registry=registry)
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

    def add_step(self, ahead: bool) -> None:
        """One step collected (the share sent ahead says how much async scheduling overlaps)."""
        self._steps.labels(self._model, "ahead" if ahead else "synchronous").inc()

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
