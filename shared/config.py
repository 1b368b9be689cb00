"""Frozen configuration dataclasses and the one helper that reads them from the environment.

Each service's ``main.py`` is the only place that calls :func:`from_env`; core code receives
these objects as arguments and never reads the environment itself.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# The largest gRPC message between kvmesh processes, each way: the largest step (``Execute`` with a
# full batch of new prompts) plus headroom; gRPC's 4 MiB default would refuse a legitimate batch.
# The one owner: every channel (``shared.channels``) and every server (``ServerConfig``) use it.
MAX_MESSAGE_BYTES = 64 << 20

T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    """Where a gRPC server listens and how it stops."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = an ephemeral port, reported once bound
    max_workers: int = 16
    grace_seconds: float = 5.0
    port_file: str = ""  # when set, the bound port is written here once the server is up
    # TLS (docs/security.md): certificate files; with a CA, client certificates are required
    # (mutual TLS) unless tls_client_auth is off; health_port: a plaintext port answering only
    # grpc.health.v1, for probes that cannot present a certificate (-1 = none).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = True
    tls_allowed_peers: str = ""  # comma-separated names; when set, the client cert's CN/SAN must be one
    health_port: int = -1
    # Largest request message accepted (internal services exchange whole steps; the scheduler,
    # facing clients, sets a smaller bound in its main.py).
    max_receive_message_bytes: int = MAX_MESSAGE_BYTES


def _coerce(raw: str, typ: Any) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw == "" and len(args) != len(typing.get_args(typ)):
            return None
        return _coerce(raw, args[0])
    if typ is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if typ in (int, float, str):
        return typ(raw)
    raise TypeError(f"cannot read {typ!r} from the environment")


def from_env(cls: type[T], prefix: str, env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Builds ``cls`` from ``{prefix}{FIELD}`` variables, e.g. ``KVMESH_SCHED_MAX_NUM_SEQS``.

    Fields without a variable keep their defaults; ``overrides`` win over both.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = prefix + field.name.upper()
        if key in env:
            try:
                values[field.name] = _coerce(env[key], hints[field.name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{key}: {exc}") from exc
    values.update(overrides)
    return cls(**values)
