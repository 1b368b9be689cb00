"""Spans of a request's life in the scheduler: queueing, and the steps it took part in.

One step serves many requests, but a span has one parent: the step span is parented to one
participating request's ``Generate`` span (the oldest that wants this step traced) and linked to
the others', so each request's trace still shows the kv-cache-manager, model-runner and
offload-store calls of a step it was in. Steps are sampled per request (the first
``trace_steps``, then every ``trace_step_every``-th) so a long answer is not thousands of spans.
When tracing is off every call here is a no-op on OpenTelemetry's default tracer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.scheduler.request import Request
from shared.span_attributes import safe_attributes

_tracer = trace.get_tracer("kvmesh.scheduler")


def capture_context() -> Any:
    """The caller's trace context (the ``Generate`` server span), to parent this request's spans."""
    span = trace.get_current_span()
    return otel_context.get_current() if span.get_span_context().is_valid else None


def wants_step_span(req: Request, first: int, every: int) -> bool:
    """Step sampling: the first ``first`` steps of a request, then every ``every``-th."""
    n = req.num_steps
    return n < first or (every > 0 and n % every == 0)


def record_queue_span(req: Request) -> None:
    """A span from arrival to first scheduling, under the request's ``Generate`` span."""
    ctx = req.trace_context
    if ctx is None or req.times.first_scheduled is None:
        return
    now_ns, now = time.time_ns(), time.monotonic()
    start = now_ns - int((now - req.times.arrival) * 1e9)
    end = now_ns - int((now - req.times.first_scheduled) * 1e9)
    span = _tracer.start_span("scheduler.queue", context=ctx, start_time=start,
                              attributes=safe_attributes({"kvmesh.request_id": req.request_id}))
    span.end(end_time=end)


@contextmanager
def step_span(step_no: int, candidates: Sequence[Request], first: int, every: int) -> Iterator[Any]:
    """The span every RPC of one step runs under (so they join the chosen request's trace)."""
    traced = [r for r in candidates if r.trace_context is not None and wants_step_span(r, first, every)]
    if not traced:
        yield None
        return
    parent, others = traced[0], traced[1:]
    links = [trace.Link(trace.get_current_span(r.trace_context).get_span_context()) for r in others]
    attrs: dict[str, str | int] = {"kvmesh.step": step_no, "kvmesh.request_id": parent.request_id,
             "kvmesh.num_traced_requests": len(traced)}
    with _tracer.start_as_current_span("scheduler.step", context=parent.trace_context, links=links,
                                       attributes=safe_attributes(attrs)) as span:
        yield span
