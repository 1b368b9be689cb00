"""API keys, tenants and the per-tenant cache salt (no gRPC here: the interceptor is in
``services/scheduler/auth.py``).

Keys file (mounted from a Kubernetes Secret in production), one key a line::

    # key                                   tenant     [min_priority]
    sk-team-a-0123456789                    team-a
    sha256:9f86d081884c7d659a2feaa0c55a...  team-b     -10

A key is either the secret itself or ``sha256:<64 hex digits>`` of it, so the file may hold only
digests. ``min_priority`` (optional) is the tenant's priority floor; without it the scheduler's
``KVMESH_SCHED_MIN_PRIORITY`` applies. See docs/security.md.

NOTE: keys are compared as SHA-256 digests with :func:`hmac.compare_digest` against every entry
(no dict lookup, no early exit), so the time a check takes says nothing about how close a guess
was. The table is reloaded when the file changes; a file that no longer parses keeps the last
good table (and logs why) instead of locking every tenant out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_SALT_DOMAIN = b"kvmesh/v1/tenant-cache-salt\x00"


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: its id and, when the keys file sets one, its priority floor."""

    id: str
    min_priority: int | None = None


@dataclass(frozen=True)
class AuthConfig:
    """How the public API authenticates (read from ``KVMESH_AUTH_*`` in the scheduler's main.py).

    Attributes:
        mode: ``auto`` (on when ``keys_file`` is set; off only on a loopback bind, refused on any
            other), ``on`` (a keys file is required) or ``off`` (one tenant, ``default``).
        keys_file: path of the keys file.
        reload_seconds: how often, at most, the file's identity (inode, size, mtime) is checked.
    """

    mode: str = "auto"
    keys_file: str = ""
    reload_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"KVMESH_AUTH_MODE must be auto, on or off, got {self.mode!r}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> list[tuple[bytes, Tenant]]:
    """Parses a keys file into (key digest, tenant) pairs; raises ValueError naming the line."""
    entries: list[tuple[bytes, Tenant]] = []
    seen: set[bytes] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"line {lineno}: expected 'key tenant [min_priority]'")
        key, tenant = parts[0], parts[1]
        if key.startswith("sha256:"):
            hex_digest = key[len("sha256:"):].lower()
            if not _HEX_RE.match(hex_digest):
                raise ValueError(f"line {lineno}: sha256: needs 64 hex digits")
            digest = bytes.fromhex(hex_digest)
        else:
            if len(key) < 16:
                raise ValueError(f"line {lineno}: a key must have at least 16 characters")
            digest = _digest(key)
        if not _TENANT_RE.match(tenant):
            raise ValueError(f"line {lineno}: tenant id {tenant!r} must match {_TENANT_RE.pattern}")
        try:
            floor = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(f"line {lineno}: min_priority must be an integer") from None
        if digest in seen:
            raise ValueError(f"line {lineno}: duplicate key")
        seen.add(digest)
        entries.append((digest, Tenant(tenant, floor)))
    return entries


class KeyStore:
    """The keys file's table, reloaded when the file changes.

    Args:
        path: the keys file (a Secret's mounted file: its symlink swap changes the inode).
        reload_seconds: at most one ``stat`` per this interval, done by the checking thread.
    """

    def __init__(self, path: str, reload_seconds: float = 1.0) -> None:
        self.path = Path(path)
        self.reload_seconds = reload_seconds
        self._lock = threading.Lock()
        self._identity = self._stat()
        self._entries = parse_keys(self.path.read_text())  # a bad file at start is fatal
        self._checked = time.monotonic()
        log.info("auth: %d API keys for %d tenants from %s", len(self._entries),
                 len({t.id for _, t in self._entries}), self.path)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_seconds:
            return
        with self._lock:
            if now - self._checked < self.reload_seconds:
                return
            self._checked = now
            try:
                identity = self._stat()
                if identity == self._identity:
                    return
                entries = parse_keys(self.path.read_text())
            except (OSError, ValueError) as exc:
                log.error("auth: keeping the previous keys, cannot reload %s: %s", self.path, exc)
                return
            self._identity, self._entries = identity, entries
            log.info("auth: reloaded %d API keys from %s", len(entries), self.path)

    def authenticate(self, key: str) -> Tenant | None:
        """The key's tenant, or None; compares against every entry in constant time each."""
        self._maybe_reload()
        digest = _digest(key)
        found: Tenant | None = None
        for entry_digest, tenant in self._entries:
            if hmac.compare_digest(entry_digest, digest):
                found = tenant
        return found


def tenant_cache_salt(deployment_key: str, tenant_id: str, client_salt: bytes = b"") -> bytes:
    """The cache salt every tier keys on: HMAC(deployment key, tenant) followed by the client's salt.

    NOTE: the tenant part is a fixed 32 bytes, so ``tenant || client salt`` is unambiguous: two
    tenants never share a block whatever salts they send, and a client salt can only split its own
    tenant's cache further. The salt enters block 0's hash, so every later block (the pool's
    hashes, the offload-store's keys and index) inherits it.
    """
    mac = hmac.new(deployment_key.encode(), _SALT_DOMAIN + tenant_id.encode(), hashlib.sha256).digest()
    return mac + client_salt
