"""Configuration of the offload-store (read from ``KVMESH_OFFLOAD_*`` by ``main.py`` only)."""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class OffloadConfig:
    """Where the store keeps its tiers and how large each may grow.

    Attributes:
        data_dir: root of the disk tier (``<data_dir>/blocks/``) and of the default SQLite index.
        db_url: SQLAlchemy URL of the index; empty means ``sqlite:///<data_dir>/index.sqlite``.
            A shared PostgreSQL index is ``postgresql+psycopg://user@host:5432/db``.
        db_table: table holding this data dir's rows. NOTE: start-up reconciliation deletes rows
            whose file is missing, so two data dirs must never share one table.
        dram_bytes: DRAM tier budget (whole blocks only; 0 disables the tier).
        disk_bytes: disk tier budget (whole files; 0 disables the tier).
        pool_dir: the only directory a ``shm_file`` pool handle may name. The store writes into
            the mapped file on Load, so an RPC must not be able to point it at any other file.
        torch_threads: torch intra-op threads of the service process (0 = torch's default, one
            per core). 1 by default: block copies are memory-bound, the store shares the node with
            the model-runner, and on a busy node every multi-threaded copy waits for a descheduled
            OpenMP worker: measured on 2 shared cores, a 128-block disk load took 0.77 s with 2
            threads and 0.08 s with 1.
        remote_url: the shared remote tier, a redis-py URL (``redis://host:6379/0``,
            ``rediss://`` for TLS); empty (the default) turns the tier off. docs/offload-remote.md.
        remote_timeout_seconds: connect and read timeout of every remote call: the longest a step
            waits on a slow or dead Redis before treating its blocks as misses.
        remote_key_prefix: namespace of this deployment's keys in the shared Redis.
        remote_ttl_seconds: expiry of a remote block, refreshed when it is served (0: none, space
            is bounded by Redis' ``maxmemory`` + ``allkeys-lru`` alone).
        remote_retry_seconds: after a failed remote call the tier is bypassed this long, so an
            outage costs one timeout per period rather than one per step.
        remote_batch_bytes: payload bytes one remote load pipeline carries (one round trip).
        remote_index_blocks: most remote block hashes this store remembers for its events (what
            it wrote or was served; services/offload_store/events.py); 0: remote residency is
            not reported. About 100 bytes each.
        max_subscribers: concurrent SubscribeEvents streams (each holds a server thread).
    """

    data_dir: str = "/var/tmp/kvmesh-offload"
    db_url: str = ""
    db_table: str = "offload_blocks"
    dram_bytes: int = 2 * GIB
    disk_bytes: int = 16 * GIB
    pool_dir: str = "/dev/shm"
    torch_threads: int = 1
    remote_url: str = ""
    remote_timeout_seconds: float = 0.2
    remote_key_prefix: str = "kvmesh:kv:"
    remote_ttl_seconds: int = 0
    remote_retry_seconds: float = 2.0
    remote_batch_bytes: int = 64 << 20
    remote_index_blocks: int = 1 << 18
    max_subscribers: int = 4

    def __post_init__(self) -> None:
        if not self.data_dir:
            raise ValueError("data_dir must be set")
        if self.dram_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("dram_bytes and disk_bytes must be >= 0")
        if self.torch_threads < 0:
            raise ValueError("torch_threads must be >= 0")
        if self.remote_timeout_seconds <= 0 or self.remote_retry_seconds < 0:
            raise ValueError("remote_timeout_seconds must be > 0 and remote_retry_seconds >= 0")
        if self.remote_ttl_seconds < 0 or self.remote_batch_bytes <= 0:
            raise ValueError("remote_ttl_seconds must be >= 0 and remote_batch_bytes > 0")
        if self.remote_index_blocks < 0 or self.max_subscribers < 1:
            raise ValueError("remote_index_blocks must be >= 0 and max_subscribers >= 1")
        if not self.db_table.isidentifier():
            raise ValueError(f"db_table must be an identifier, got {self.db_table!r}")

    @property
    def resolved_db_url(self) -> str:
        """The index URL, defaulting to SQLite inside ``data_dir``."""
        if self.db_url:
            return self.db_url
        return "sqlite:///" + os.path.join(os.path.abspath(self.data_dir), "index.sqlite")
