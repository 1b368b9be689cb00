"""What kvmesh puts on a span: counts, bools and a few known ids, never user content.

Spans must never carry prompt text, token ids or cache salts (they would leak user data into a
tracing backend with weaker access control than the API), so every attribute kvmesh code puts on
a span passes :func:`safe_attributes`, directly or through :func:`set_attributes`: the
scheduler's queue and step spans and the router's decision do, and ``tests/deploy/test_telemetry.py``
fails on a span attribute in ``services/`` that does not. Kept apart from ``telemetry.py`` (the
SDK and gRPC set-up) so core modules can use it without importing gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)

# String-valued attributes allowed on spans. Everything else must be a number or a bool: prompt
# text, token id lists and salts are strings or sequences and are therefore dropped.
SAFE_STRING_KEYS = frozenset({
    "kvmesh.request_id",
    "kvmesh.finish_reason",
    "kvmesh.attention_backend",
    "kvmesh.offload.tier",
    "kvmesh.router.replica",  # a replica id from the router's configuration
    "kvmesh.router.policy",  # "kv_aware" or "round_robin"
    "gen_ai.request.model",
    "gen_ai.response.finish_reasons",
    "gen_ai.operation.name",
    "gen_ai.system",
})


def safe_attributes(attrs: Mapping[str, object]) -> dict[str, AttributeValue]:
    """Keeps only attributes that cannot carry user content.

    Numbers and bools pass under any key; strings (and sequences of strings) pass only under
    :data:`SAFE_STRING_KEYS`. Anything else (prompt text, token id lists, salts, bytes) is dropped.
    """
    out: dict[str, AttributeValue] = {}
    for key, value in attrs.items():
        if value is None:
            continue
        if isinstance(value, bool | int | float):
            out[key] = value
        elif key in SAFE_STRING_KEYS:
            if isinstance(value, str):
                out[key] = value
            elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
                out[key] = [str(v) for v in value]
            else:
                log.debug("dropped span attribute %s (not a string)", key)
        else:
            log.debug("dropped span attribute %s (strings allowed only under known keys)", key)
    return out


def set_attributes(span: trace.Span, attrs: Mapping[str, object]) -> None:
    """Sets only the attributes :func:`safe_attributes` keeps (free when the span is not recording)."""
    if span.is_recording():
        span.set_attributes(safe_attributes(attrs))
