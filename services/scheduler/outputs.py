"""The engine's output side: one queue per live request, admission accounting, finished-request metrics.

Producers (gRPC handler threads, the in-process stream) register a request here and read its
queue; the loop thread pushes each step's tokens and every request's final record. A request
leaves the bounded admission queue at its first scheduling, and leaves this fan-out with its
final record (a stream that sees ``finished`` reads nothing more).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics, request_metrics
from services.scheduler.request import FinishReason, Request, RequestSpec
from services.scheduler.scheduler import ScheduledStep, Scheduler, TokenEvent
from services.scheduler.types import RequestMetrics
from shared.errors import InvalidArgument, KVMeshError, ResourceExhausted


@dataclass(frozen=True)
class EngineOutput:
    """What one step produced for one request (or its end)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Any, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    metrics: RequestMetrics | None = None
    error: KVMeshError | None = None


class OutputQueues:
    """Per-request output queues and the admission bound; safe to call from many threads."""

    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics | None) -> None:
        self.config = config
        self.metrics = metrics
        self._queues: dict[str, queue.SimpleQueue[EngineOutput]] = {}
        self._lock = threading.Lock()
        self._queued_requests = 0  # added but not yet first scheduled (admission control)
        self._queued_tokens = 0
        self._preemptions_seen = 0

    def register(self, spec: RequestSpec) -> queue.SimpleQueue[EngineOutput]:
        """Admits a request; returns the queue its outputs arrive on.

        Raises:
            ResourceExhausted: the waiting queue is full (requests or tokens).
            InvalidArgument: the request id is already in use.
        """
        n_tokens = len(spec.prompt_token_ids)
        with self._lock:
            if spec.request_id in self._queues:
                raise InvalidArgument(f"request_id: {spec.request_id!r} is already in use")
            if self._queued_requests >= self.config.max_waiting_requests:
                raise ResourceExhausted(
                    f"waiting queue is full ({self.config.max_waiting_requests} requests); retry later")
            if self._queued_tokens + n_tokens > self.config.max_waiting_tokens:
                raise ResourceExhausted(
                    f"waiting queue is full ({self.config.max_waiting_tokens} prompt tokens); retry later")
            self._queued_requests += 1
            self._queued_tokens += n_tokens
            q: queue.SimpleQueue[EngineOutput] = queue.SimpleQueue()
            self._queues[spec.request_id] = q
        return q

    def live_ids(self) -> list[str]:
        """Requests registered and not yet ended (their streams are still open)."""
        with self._lock:
            return list(self._queues)

    def on_dequeued(self, req: Request) -> None:
        """Admission accounting: a request leaves the bounded queue at its first scheduling."""
        if req.in_admission_queue:
            req.in_admission_queue = False
            with self._lock:
                self._queued_requests -= 1
                self._queued_tokens -= req.num_prompt_tokens

    def push(self, events: Sequence[TokenEvent]) -> None:
        """One step's tokens, each to its request's queue (a finished one with its final record)."""
        if self.metrics is not None:  # every gap between two tokens, as it happens
            self.metrics.observe_inter_token([g for ev in events if (g := ev.request.times.last_gap) is not None])
        for ev in events:
            with self._lock:
                q = self._queues.get(ev.request_id)
            if q is None:
                continue
            if ev.finished:
                req = ev.request
                self._finish(ev.request_id, EngineOutput(
                    ev.request_id, (ev.token_id,), (ev.logprobs,), True, req.finish_reason,
                    req.stop_reason, request_metrics(req),
                ))
            else:
                q.put(EngineOutput(ev.request_id, (ev.token_id,), (ev.logprobs,)))

    def emit_final(self, req: Request, error: KVMeshError | None = None) -> None:
        """Ends a request's stream outside a step's tokens (abort, expiry, failure, shutdown)."""
        self._finish(req.request_id, EngineOutput(
            req.request_id, finished=True, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, metrics=request_metrics(req), error=error,
        ))

    def _finish(self, request_id: str, out: EngineOutput) -> None:
        self._observe_finished(out)
        with self._lock:
            q = self._queues.pop(request_id, None)
        if q is not None:
            q.put(out)

    def _observe_finished(self, out: EngineOutput) -> None:
        if self.metrics is None or out.metrics is None:
            return
        m = out.metrics
        reason = "error" if out.error is not None else (out.finish_reason or FinishReason.ABORT).value
        self.metrics.observe_finished(
            finished_reason=reason, e2e_s=m.e2e_seconds, queue_s=m.queue_seconds,
            ttft_s=m.ttft_seconds if m.completion_tokens else None, prompt_tokens=m.prompt_tokens,
            generation_tokens=m.completion_tokens)

    def record_step(self, sched: Scheduler, step: ScheduledStep, num_generated: int) -> None:
        """A step's token counts and the preemptions it caused.

        ``num_generated``: the tokens the step gave requests (not the runner's count: a step sent
        ahead samples a token for a request that its previous step ended, and nobody gets it).
        """
        if self.metrics is None:
            return
        decodes = len(step.step_input.cached_requests)
        self.metrics.add_step(ahead=not step.allocated)
        self.metrics.add_step_tokens(max(step.total_tokens - decodes, 0), num_generated)
        if sched.num_preemptions > self._preemptions_seen:
            self.metrics.num_preemptions.inc(sched.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = sched.num_preemptions

    def publish_queues(self, sched: Scheduler) -> None:
        """Queue gauges as they stand after the step's finished requests left (not before)."""
        if self.metrics is not None:
            self.metrics.set_queues(len(sched.running), len(sched.waiting))
