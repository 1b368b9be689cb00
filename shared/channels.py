"""Every client-side channel in kvmesh is opened here, so TLS, keepalive and message sizes are
set once, on purpose, for all of them (scheduler -> kv-cache-manager / model-runner /
offload-store, the launcher's health wait, the Python client and the CLI).

A process's ``main`` (or the CLI) calls :func:`configure` once with its certificate files;
:func:`open_channel` then uses them unless a caller passes its own.

Options (see docs/security.md):

* keepalive: a ping every 30 s while calls are open, 10 s to answer, so a peer that vanished
  without a FIN (a killed pod, a dropped route) ends its streams instead of hanging them; servers
  accept pings at that rate (``shared/grpc_server.py``);
* message size: ``shared.config.MAX_MESSAGE_BYTES`` each way (why that size is written there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from shared.config import MAX_MESSAGE_BYTES
from shared.tls import TLSFiles, channel_credentials

__all__ = ["CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "configure", "default_tls", "open_aio_channel", "open_channel"]

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # NOTE: a restarted peer is reached again within about a second (grpc's default reconnect
    # backoff grows to two minutes while the peer is down, so requests kept failing long after
    # a restarted dependency was back).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

_default = TLSFiles()


def configure(tls: TLSFiles) -> None:
    """Sets the certificate files channels of this process use by default (called once by main)."""
    global _default
    _default = tls


def default_tls() -> TLSFiles:
    """The files set by :func:`configure` (plaintext until then)."""
    return _default


def _options(files: TLSFiles, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    opts = [*CHANNEL_OPTIONS, *options]
    if files.server_name:
        opts.append(("grpc.ssl_target_name_override", files.server_name))
    return opts


def open_channel(address: str, *, tls: TLSFiles | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to ``address``: TLS when ``tls`` (or the configured default) names files."""
    files = _default if tls is None else tls
    opts = _options(files, options)
    if files.enabled:
        return grpc.secure_channel(address, channel_credentials(files), options=opts)
    return grpc.insecure_channel(address, options=opts)


def open_aio_channel(address: str, *, tls: TLSFiles | None = None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """:func:`open_channel` for asyncio (``grpc.aio``): the same options and TLS rules.

    NOTE: create it inside the event loop that will use it (an aio channel binds to its loop).
    """
    files = _default if tls is None else tls
    opts = _options(files, options)
    if files.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(files), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)
