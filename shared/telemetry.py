"""OpenTelemetry tracing for every kvmesh service: set-up from ``OTEL_*`` variables, gRPC hooks.

A service's ``main.py`` calls, before it creates its server or dials its peers::

    provider = setup_tracing("scheduler", os.environ)       # None when tracing is off
    running = start_server(cfg, regs, interceptors=server_interceptors())
    channel = instrument_grpc_client(grpc.insecure_channel(address))

One request then shows up as one trace: the client span of each outgoing call and the server
span of the peer that handled it share a trace id, linked through the W3C ``traceparent``
metadata the interceptors inject and extract.

Tracing is **off unless asked for**: with neither ``OTEL_TRACES_EXPORTER`` nor an OTLP endpoint
set, nothing is installed, the hooks return no interceptors and the channel unchanged, so an
untraced deployment pays nothing per call.

Which variables are read where (``env`` is what ``main.py`` passes, normally ``os.environ``):

- from ``env``: ``OTEL_SDK_DISABLED``, ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``,
  comma-separated), ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``
  (only ``grpc`` is installed), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (the SDK's
  names and defaults), ``OTEL_SERVICE_NAME`` (overrides the service's own name);
- by the SDK itself, from the process environment: the exporter's fine print (headers, timeout,
  compression, certificates, ``..._INSECURE``), ``OTEL_RESOURCE_ATTRIBUTES`` and the batch span
  processor's ``OTEL_BSP_*`` knobs.

NOTE: the server interceptor must be in the server's interceptor list when ``grpc.server()`` is
called (the auto-instrumentor patches ``grpc.server`` itself, so a server created before it runs
has no spans). Passing :func:`server_interceptors` to ``start_server`` satisfies that by
construction.

Spans must never carry prompt text, token ids or cache salts (they would leak user data into a
tracing backend with weaker access control than the API): the filter every span attribute
passes is ``shared/span_attributes.py`` (no gRPC there, so core modules use it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)

log = logging.getLogger(__name__)

SERVICE_NAMESPACE = "kvmesh"
EXPORTERS = frozenset({"otlp", "console", "none"})



def _truthy(raw: str | None) -> bool:
    return (raw or "").strip().lower() == "true"


def _first(env: Mapping[str, str], *keys: str) -> str:
    """The first non-empty value among ``keys`` (signal-specific variables come first)."""
    for key in keys:
        value = env.get(key, "").strip()
        if value:
            return value
    return ""


def sampler_from_env(env: Mapping[str, str]) -> Sampler:
    """The sampler named by ``OTEL_TRACES_SAMPLER`` / ``_ARG``, with the SDK's names and defaults.

    NOTE: the SDK would read these from ``os.environ`` itself; reading them from ``env`` keeps
    ``main.py`` the only place that touches the environment, and keeps this testable.
    """
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    fixed: dict[str, Sampler] = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "parentbased_always_on": DEFAULT_ON,
        "parentbased_always_off": DEFAULT_OFF,
    }
    if name in fixed:
        return fixed[name]
    if name in ("traceidratio", "parentbased_traceidratio"):
        try:
            rate = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            log.warning("OTEL_TRACES_SAMPLER_ARG is not a number; sampling everything")
            rate = 1.0
        if not 0.0 <= rate <= 1.0:
            log.warning("OTEL_TRACES_SAMPLER_ARG %s is outside [0, 1]; sampling everything", rate)
            rate = 1.0
        return TraceIdRatioBased(rate) if name == "traceidratio" else ParentBasedTraceIdRatio(rate)
    log.warning("unknown OTEL_TRACES_SAMPLER %r; using parentbased_always_on", name)
    return DEFAULT_ON


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    """Exporters asked for; an OTLP endpoint alone implies ``otlp`` (the spec's default)."""
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        endpoint = _first(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = sorted(set(names) - EXPORTERS)
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported {unknown}; use otlp, console or none")
    return [n for n in names if n != "none"]


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = _first(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol != "grpc":
        raise ValueError(f"OTLP protocol {protocol!r} is not installed; kvmesh exports OTLP over grpc only")
    # Imported here so that a process with tracing off never loads the exporter's gRPC stubs.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    endpoint = _first(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    # None lets the SDK apply its default (localhost:4317); an http:// endpoint means plaintext.
    return OTLPSpanExporter(endpoint=endpoint or None)


def setup_tracing(service_name: str, env: Mapping[str, str], *,
                  set_global: bool = True) -> TracerProvider | None:
    """Builds (and by default installs) the process's tracer provider from ``OTEL_*`` variables.

    Args:
        service_name: this service's ``service.name`` (e.g. ``"scheduler"``); ``OTEL_SERVICE_NAME``
            in ``env`` wins, so an operator can tell replicas apart.
        env: the variables to read, normally ``os.environ`` passed by ``main.py``.
        set_global: install the provider as OpenTelemetry's global one, which the hooks below
            use by default. Tests pass False to keep the process-wide state untouched.

    Returns:
        The provider, or None when tracing is off (``OTEL_SDK_DISABLED=true``, exporter ``none``,
        or neither an exporter nor an endpoint configured); then nothing is installed.

    Raises:
        ValueError: an exporter or OTLP protocol that this installation cannot provide.
    """
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return None
    names = _exporter_names(env)
    if not names:
        return None
    name = env.get("OTEL_SERVICE_NAME", "").strip() or service_name
    resource = Resource.create({"service.name": name, "service.namespace": SERVICE_NAMESPACE})
    provider = TracerProvider(resource=resource, sampler=sampler_from_env(env))
    for exporter_name in names:
        exporter = _otlp_exporter(env) if exporter_name == "otlp" else ConsoleSpanExporter()
        # Batching keeps export off the request path: spans are queued and sent by a thread.
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    log.info("tracing on: service.name=%s exporters=%s", name, ",".join(names))
    return provider


def _active_provider(tracer_provider: trace.TracerProvider | None) -> trace.TracerProvider | None:
    """The provider to instrument with, or None when tracing is off (no SDK provider anywhere)."""
    if tracer_provider is not None:
        return tracer_provider
    current = trace.get_tracer_provider()
    return current if isinstance(current, TracerProvider) else None


def _filter(trace_health_checks: bool) -> Any:
    # NOTE: Kubernetes probes call grpc.health.v1 every few seconds; tracing them would bury the
    # request traces, so they are skipped unless asked for.
    if trace_health_checks:
        return None
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.health_check())


def server_interceptors(tracer_provider: trace.TracerProvider | None = None, *,
                        trace_health_checks: bool = False) -> list[grpc.ServerInterceptor]:
    """Interceptors to pass to ``start_server`` so each incoming call gets a SERVER span.

    Returns an empty list when tracing is off, so an untraced server has no extra layer.
    """
    provider = _active_provider(tracer_provider)
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(tracer_provider=provider, filter_=_filter(trace_health_checks))]


def instrument_grpc_client(channel: grpc.Channel, tracer_provider: trace.TracerProvider | None = None, *,
                           trace_health_checks: bool = False) -> grpc.Channel:
    """Wraps ``channel`` so each outgoing call gets a CLIENT span and carries the trace context.

    Returns ``channel`` itself when tracing is off; otherwise a wrapper whose ``close()`` closes
    ``channel`` too, so callers keep one object either way.
    """
    provider = _active_provider(tracer_provider)
    if provider is None:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    interceptor = client_interceptor(tracer_provider=provider, filter_=_filter(trace_health_checks))
    wrapped: grpc.Channel = intercept_channel(channel, interceptor)
    return wrapped


def get_tracer(name: str, tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """A tracer for kvmesh's own spans (a no-op tracer when tracing is off)."""
    return trace.get_tracer(name, tracer_provider=tracer_provider)
