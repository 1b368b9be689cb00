"""The model-runner's Prometheus metrics: the per-step cost of the model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from shared.metrics import MODEL_LABEL, PREFIX, token_buckets

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
