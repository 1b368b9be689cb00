"""The remote tier: KV blocks in one Redis (or Valkey, or Redis Cluster) shared by every replica.

::

    key:   <key_prefix><block hash, hex>      (the chained hash: deployment key, model, tenant salt)
    value: MAGIC | version | rank | dtype len | 0 | nbytes u64 | shape u32 x rank | dtype | crc32 | payload
           └──────────────── format prefix (the same bytes for every block of a pool) ┘

A value is served only when its format prefix equals the pool's (version, dtype and the layout
``[layers, 2, block_size, kv_heads, head_dim]``) and the payload's CRC-32 matches: anything else
is a *miss* (counted as a mismatch or a corruption), never wrong KV. A corrupt value is deleted so
no replica trips on it again; a value of another format is left for the pools that can use it.

Every batch is one pipeline, so a run of blocks costs one round trip. Redis is an optimisation,
never a dependency: a failed or slow call (bounded by the socket timeouts, no client-side retries)
is counted, logged once per outage, answered as a miss, and the tier is not asked again for
``retry_seconds``, so a dead Redis costs one timeout per period instead of one per step. Space is
Redis' own business (``maxmemory`` with ``allkeys-lru``, docs/offload-remote.md); an optional TTL
bounds how long an unused block may linger.
"""

from __future__ import annotations

import logging
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.offload_store.config import OffloadConfig
from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash

log = logging.getLogger(__name__)
T = TypeVar("T")

MAGIC = b"KVMR"
VERSION = 1
_FIXED = struct.Struct("<4sBBBxQ")  # magic, version, rank, dtype length, pad, nbytes
_CRC = struct.Struct("<I")
_PROBE_BYTES = 128  # GETRANGE length of a lookup: more than any format prefix (rank 5, short dtype)


def format_prefix(fmt: BlockFormat, version: int = VERSION) -> bytes:
    """The header bytes every block of ``fmt`` starts with (before its checksum)."""
    dtype = fmt.dtype.encode()
    return (_FIXED.pack(MAGIC, version, len(fmt.shape), len(dtype), fmt.nbytes)
            + struct.pack(f"<{len(fmt.shape)}I", *fmt.shape) + dtype)


def parse_prefix(value: bytes) -> BlockFormat | None:
    """The format a value claims (None: not a block of this version), read from its prefix."""
    if len(value) < _FIXED.size:
        return None
    magic, version, rank, dlen, nbytes = _FIXED.unpack_from(value)
    end = _FIXED.size + 4 * rank + dlen
    if magic != MAGIC or version != VERSION or len(value) < end:
        return None
    shape = struct.unpack_from(f"<{rank}I", value, _FIXED.size)
    return BlockFormat(value[end - dlen:end].decode(errors="replace"), tuple(shape), nbytes)


def encode_block(fmt: BlockFormat, payload: memoryview) -> bytes:
    """The stored value of one block: format prefix, CRC-32 of the payload, the payload."""
    return b"".join((format_prefix(fmt), _CRC.pack(zlib.crc32(payload) & 0xFFFFFFFF), payload))


@dataclass
class RemoteStats:
    """What the remote tier did, in blocks, bytes and calls."""

    hits: int = 0  # blocks served (format and checksum verified)
    misses: int = 0  # blocks asked for and absent
    mismatches: int = 0  # present in another format or version: a miss
    corruptions: int = 0  # wrong length or checksum: a miss, the key deleted
    saves: int = 0  # blocks written
    skipped_saves: int = 0  # already there (another replica wrote them): nothing sent
    errors: int = 0  # calls that failed: Redis down, refused or slower than the timeout
    bypassed: int = 0  # calls not attempted while backing off after an error
    bytes_read: int = 0  # payload bytes served
    bytes_written: int = 0  # value bytes sent
    round_trips: int = 0  # pipelines executed (successful or not)


class RemoteTier:
    """Blocks by hash in a shared Redis.

    Args:
        client: a ``redis.Redis`` (see :func:`connect`: timeouts set, retries off).
        key_prefix: prepended to every key (a namespace per deployment, or per test).
        ttl_seconds: expiry of a written or served block (0: none, ``maxmemory`` LRU alone).
        retry_seconds: how long the tier stays bypassed after a failed call.
        batch_bytes: payload bytes one load pipeline may carry (bounds this process' memory).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, client: redis.Redis, key_prefix: str, ttl_seconds: int = 0, retry_seconds: float = 2.0,
                 batch_bytes: int = 64 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self.retry_seconds = retry_seconds
        self.batch_bytes = batch_bytes
        self.stats = RemoteStats()
        self.last_error = ""  # the exception class of the last failed call ("" once recovered)
        self._clock = clock
        self._retry_at = 0.0  # bypassed until then
        self._down = False  # in an outage (logged once, when it starts)

    def key(self, block_hash: BlockHash) -> str:
        """The Redis key of a block."""
        return self.key_prefix + block_hash.hex()

    def close(self) -> None:
        """Closes the client's connections."""
        self.client.close()

    def batch_blocks(self, fmt: BlockFormat) -> int:
        """Blocks of ``fmt`` per load pipeline."""
        return max(1, self.batch_bytes // max(1, fmt.nbytes))

    def present(self, hashes: Sequence[BlockHash], fmt: BlockFormat | None) -> list[bool]:
        """Per hash, whether a block of ``fmt`` (any format when None) is stored; one round trip.

        Reads only each value's first bytes; the checksum is verified on load.
        """
        if not hashes:
            return []
        expect = format_prefix(fmt) if fmt is not None else None
        replies = self._pipeline(lambda p: [p.getrange(self.key(h), 0, _PROBE_BYTES - 1) for h in hashes])
        if replies is None:
            return [False] * len(hashes)
        if expect is not None:
            return [bool(r) and r[: len(expect)] == expect for r in replies]
        return [bool(r) and parse_prefix(r) is not None for r in replies]

    def get_many(self, hashes: Sequence[BlockHash], fmt: BlockFormat) -> list[memoryview | None]:
        """The verified payloads (``fmt.nbytes`` bytes each) of the leading run of ``hashes``, then
        None from the first miss on; one round trip. A load stops at its first miss, so the values
        after it are neither verified nor counted."""
        if not hashes:
            return []
        ttl = self.ttl_seconds

        def queue(p: Any) -> None:
            for h in hashes:  # GETEX refreshes the expiry of what is still in use
                if ttl:
                    p.getex(self.key(h), ex=ttl)
                else:
                    p.get(self.key(h))

        replies = self._pipeline(queue)
        if replies is None:
            return [None] * len(hashes)
        expect = format_prefix(fmt)
        out: list[memoryview | None] = []
        corrupt: list[BlockHash] = []
        for h, value in zip(hashes, replies, strict=True):
            out.append(self._verify(h, value, fmt, expect, corrupt) if not out or out[-1] is not None else None)
        if corrupt:
            log.warning("remote tier: %d corrupt block(s) deleted, e.g. %s", len(corrupt), self.key(corrupt[0]))
            self._pipeline(lambda p: [p.delete(self.key(h)) for h in corrupt])
        return out

    def get_batch(self, hashes: Sequence[BlockHash], fmt: BlockFormat,
                  held: Callable[[BlockHash], bool]) -> dict[BlockHash, memoryview | None]:
        """:meth:`get_many` of the next :meth:`batch_blocks` of ``hashes`` not ``held`` locally."""
        want: list[BlockHash] = []
        for h in hashes:
            if len(want) == self.batch_blocks(fmt):
                break
            if not held(h):
                want.append(h)
        return dict(zip(want, self.get_many(want, fmt), strict=True))

    def put_many(self, items: Sequence[tuple[BlockHash, BlockFormat, torch.Tensor]],
                 stored: list[BlockHash] | None = None) -> int:
        """Writes blocks that are not stored yet; returns how many were written.

        Two round trips: which keys exist (refreshing their TTL, if any), then the new values.

        Args:
            stored: extended with the hashes known stored afterwards (written, or already there):
                what the store's remote events report.
        """
        if not items:
            return 0
        ttl = self.ttl_seconds
        held = self._pipeline(lambda p: [p.expire(self.key(h), ttl) if ttl else p.exists(self.key(h))
                                         for h, _, _ in items])
        if held is None:
            return 0
        todo = [(h, fmt, row) for (h, fmt, row), there in zip(items, held, strict=True) if not there]
        self.stats.skipped_saves += len(items) - len(todo)
        if stored is not None:
            stored.extend(h for (h, _, _), there in zip(items, held, strict=True) if there)
        if not todo:
            return 0
        values = [(self.key(h), encode_block(fmt, row.numpy().data)) for h, fmt, row in todo]
        if self._pipeline(lambda p: [p.set(k, v, ex=ttl or None) for k, v in values]) is None:
            return 0
        self.stats.saves += len(values)
        if stored is not None:
            stored.extend(h for h, _, _ in todo)
        self.stats.bytes_written += sum(len(v) for _, v in values)
        return len(values)

    # --- internals -------------------------------------------------------------------------------

    def _verify(self, h: BlockHash, value: bytes | None, fmt: BlockFormat, expect: bytes,
                corrupt: list[BlockHash]) -> memoryview | None:
        if value is None:
            self.stats.misses += 1
            return None
        if value[: len(expect)] != expect:
            self.stats.mismatches += 1
            return None
        view = memoryview(value)
        payload = view[len(expect) + _CRC.size:]
        crc_ok = len(value) >= len(expect) + _CRC.size and _CRC.unpack_from(value, len(expect))[0] == (
            zlib.crc32(payload) & 0xFFFFFFFF)
        if len(payload) != fmt.nbytes or not crc_ok:
            self.stats.corruptions += 1
            corrupt.append(h)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(payload)
        return payload

    def _pipeline(self, queue: Callable[[Any], object]) -> list[Any] | None:
        """Runs the commands ``queue`` adds as one pipeline; None when Redis failed or is bypassed."""
        now = self._clock()
        if now < self._retry_at:
            self.stats.bypassed += 1
            return None
        pipe = self.client.pipeline(transaction=False)  # no MULTI: cluster-safe, one round trip
        queue(pipe)
        self.stats.round_trips += 1
        try:
            replies = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self.stats.errors += 1
            self.last_error = type(exc).__name__
            self._retry_at = self._clock() + self.retry_seconds
            if not self._down:
                log.warning("remote tier unavailable (%s: %s): serving misses, retrying every %.1f s",
                            type(exc).__name__, exc, self.retry_seconds)
            self._down = True
            return None
        if self._down:
            log.info("remote tier reachable again")
            self._down = False
            self.last_error = ""
        return list(replies)


def connect(url: str, timeout_seconds: float) -> redis.Redis:
    """A client whose every call is bounded by ``timeout_seconds`` (connect and each read).

    NOTE: redis-py retries a failed call 3 times by default, which would multiply the bound: off.
    Reads are 1 MiB (redis-py's default is 64 KiB): a block value is most of a megabyte, and the
    pure-Python reply parser copies once per read (docs/offload-remote.md, measured there).
    """
    return redis.Redis.from_url(url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0, socket_read_size=1 << 20)


def copy_payload(payload: memoryview, out: torch.Tensor) -> None:
    """Copies a verified payload into a contiguous CPU uint8 row."""
    np.copyto(out.numpy(), np.frombuffer(payload, dtype=np.uint8))


def open_remote(config: OffloadConfig) -> RemoteTier | None:
    """The remote tier ``config`` asks for (None when ``remote_url`` is empty). Connects lazily:
    a Redis that is down at start-up is an outage like any other, not a start-up failure."""
    if not config.remote_url:
        return None
    return RemoteTier(connect(config.remote_url, config.remote_timeout_seconds), config.remote_key_prefix,
                      config.remote_ttl_seconds, config.remote_retry_seconds, config.remote_batch_bytes)
