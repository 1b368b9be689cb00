"""The remote tier against the real Redis at 127.0.0.1:6379 (own key prefix per test).

Blocks round-trip bitwise; a value whose checksum, length, format or version does not match is a
miss (counted), never bytes handed out; a run of blocks costs one round trip, counted on the real
client's socket writes; a Redis that never answers costs one timeout, then the tier backs off.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from services.offload_store.remote_tier import (
    RemoteTier,
    connect,
    encode_block,
    format_prefix,
    parse_prefix,
)
from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash

pytestmark = pytest.mark.redis

FMT = BlockFormat("float32", (2, 2, 4, 2, 8), 2 * 2 * 4 * 2 * 8 * 4)  # 1,024 bytes


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "big") * 8)


def _row(seed: int, nbytes: int = FMT.nbytes) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class CountingConnection(redis.Connection):
    """The real redis-py connection, counting its socket writes: one per round trip."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


@pytest.fixture
def tier(redis_url: str, remote_prefix: str) -> Iterator[RemoteTier]:
    t = RemoteTier(connect(redis_url, 2.0), remote_prefix)
    yield t
    t.close()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client, to look at and tamper with what the tier stored."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_round_trip_is_bitwise(tier: RemoteTier, raw: redis.Redis) -> None:
    rows = [_row(i) for i in range(5)]
    assert tier.put_many([(_h(i), FMT, r) for i, r in enumerate(rows)]) == 5
    got = tier.get_many([_h(i) for i in range(6)], FMT)
    assert [bytes(p) if p is not None else None for p in got] == [r.numpy().tobytes() for r in rows] + [None]
    s = tier.stats
    assert (s.saves, s.hits, s.misses, s.corruptions, s.mismatches, s.errors) == (5, 5, 1, 0, 0, 0)
    assert s.bytes_read == 5 * FMT.nbytes
    value = raw.get(tier.key(_h(0)))
    assert value is not None and len(value) == len(format_prefix(FMT)) + 4 + FMT.nbytes
    assert s.bytes_written == 5 * len(value)
    assert parse_prefix(value) == FMT
    # a second save of the same blocks sends no values
    assert tier.put_many([(_h(i), FMT, r) for i, r in enumerate(rows)]) == 0
    assert tier.stats.skipped_saves == 5 and tier.stats.saves == 5


def test_presence_checks_format_without_reading_values(tier: RemoteTier) -> None:
    tier.put_many([(_h(0), FMT, _row(0)), (_h(2), FMT, _row(2))])
    assert tier.present([_h(0), _h(1), _h(2)], FMT) == [True, False, True]
    assert tier.present([_h(0), _h(2)], None) == [True, True]  # no pool yet: any format counts
    other = BlockFormat("float32", (2, 2, 4, 8, 2), FMT.nbytes)  # same size, other layout
    assert tier.present([_h(0), _h(2)], other) == [False, False]


@pytest.mark.parametrize("where", ["payload", "checksum", "truncated"])
def test_bad_value_is_a_miss_and_deleted(tier: RemoteTier, raw: redis.Redis, where: str) -> None:
    tier.put_many([(_h(i), FMT, _row(i)) for i in range(3)])
    key = tier.key(_h(1))
    value = bytearray(raw.get(key) or b"")
    head = len(format_prefix(FMT))
    if where == "payload":
        value[head + 4 + 100] ^= 0x01
    elif where == "checksum":
        value[head] ^= 0x80
    else:
        value = value[:-1]
    raw.set(key, bytes(value))
    got = tier.get_many([_h(0), _h(1), _h(2)], FMT)
    assert [p is not None for p in got] == [True, False, False]  # a run: nothing after the miss
    assert (tier.stats.corruptions, tier.stats.hits, tier.stats.misses) == (1, 1, 0)
    assert raw.exists(key) == 0  # nobody trips on it again
    assert tier.get_many([_h(2)], FMT)[0] is not None


@pytest.mark.parametrize("other", [
    BlockFormat("float16", (2, 2, 4, 2, 16), FMT.nbytes),  # other dtype, same bytes
    BlockFormat("float32", (2, 2, 8, 2, 4), FMT.nbytes),  # other block size / head dim, same bytes
    BlockFormat("float32", (4, 2, 4, 2, 8), 2 * FMT.nbytes),  # other layer count
])
def test_format_mismatch_is_a_miss_and_kept(tier: RemoteTier, raw: redis.Redis, other: BlockFormat) -> None:
    tier.put_many([(_h(0), FMT, _row(0))])
    assert tier.get_many([_h(0)], other) == [None]
    assert (tier.stats.mismatches, tier.stats.hits, tier.stats.corruptions) == (1, 0, 0)
    assert raw.exists(tier.key(_h(0))) == 1  # left for the pools that can use it
    assert [bytes(p) for p in tier.get_many([_h(0)], FMT) if p is not None] == [_row(0).numpy().tobytes()]


def test_other_version_is_a_miss(tier: RemoteTier, raw: redis.Redis) -> None:
    value = bytearray(encode_block(FMT, _row(0).numpy().data))
    value[4] = 99  # the version byte
    raw.set(tier.key(_h(0)), bytes(value))
    assert tier.get_many([_h(0)], FMT) == [None] and tier.stats.mismatches == 1
    assert tier.present([_h(0)], None) == [False]


def test_a_run_of_blocks_is_one_round_trip(redis_url: str, remote_prefix: str) -> None:
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection, socket_timeout=2.0)
    tier = RemoteTier(redis.Redis(connection_pool=pool), remote_prefix)
    try:
        tier.client.ping()  # the connection's handshake is not part of what is measured
        CountingConnection.sends = 0
        tier.put_many([(_h(i), FMT, _row(i)) for i in range(16)])
        assert CountingConnection.sends == 2  # which exist, then the 16 values
        CountingConnection.sends = 0
        assert tier.present([_h(i) for i in range(16)], FMT) == [True] * 16
        assert CountingConnection.sends == 1
        CountingConnection.sends = 0
        assert all(p is not None for p in tier.get_many([_h(i) for i in range(16)], FMT))
        assert CountingConnection.sends == 1
        assert tier.stats.round_trips == 4
    finally:
        tier.close()


def test_batches_are_bounded_by_bytes(redis_url: str, remote_prefix: str) -> None:
    tier = RemoteTier(connect(redis_url, 2.0), remote_prefix, batch_bytes=3 * FMT.nbytes)
    try:
        tier.put_many([(_h(i), FMT, _row(i)) for i in range(5)])
        got = tier.get_batch([_h(i) for i in range(5)], FMT, held=lambda h: h == _h(1))
        assert list(got) == [_h(0), _h(2), _h(3)]  # the held block is skipped, three per trip
        assert tier.stats.round_trips == 3
    finally:
        tier.close()


def test_ttl_is_set_and_refreshed(redis_url: str, remote_prefix: str, raw: redis.Redis) -> None:
    tier = RemoteTier(connect(redis_url, 2.0), remote_prefix, ttl_seconds=600)
    try:
        tier.put_many([(_h(0), FMT, _row(0))])
        assert 590 < raw.ttl(tier.key(_h(0))) <= 600
        raw.expire(tier.key(_h(0)), 5)
        assert tier.get_many([_h(0)], FMT)[0] is not None
        assert 590 < raw.ttl(tier.key(_h(0))) <= 600
    finally:
        tier.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections and never answers."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


@pytest.mark.timeout(60)  # without the socket timeout the first call would hang here forever
def test_silent_redis_costs_one_timeout_then_backs_off(silent_server: int, caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    clock = _Clock()
    tier = RemoteTier(connect(f"redis://127.0.0.1:{silent_server}/0", 0.2), "k:", retry_seconds=5.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="services.offload_store.remote_tier")
    try:
        assert tier.present([_h(0), _h(1)], FMT) == [False, False]
        assert (tier.stats.errors, tier.last_error) == (1, "TimeoutError")
        assert tier.get_many([_h(0)], FMT) == [None]  # backing off: not even tried
        assert tier.put_many([(_h(0), FMT, _row(0))]) == 0
        assert (tier.stats.errors, tier.stats.bypassed) == (1, 2)
        clock.now += 5.0
        assert tier.get_many([_h(0)], FMT) == [None]
        assert (tier.stats.errors, tier.stats.bypassed) == (2, 2)
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1  # once per outage
    finally:
        tier.close()


def test_closed_port_is_an_error_and_recovery_is_noticed(redis_url: str, remote_prefix: str) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    clock = _Clock()
    tier = RemoteTier(connect(f"redis://127.0.0.1:{port}/0", 0.2), remote_prefix, clock=clock)
    try:
        assert tier.put_many([(_h(0), FMT, _row(0))]) == 0
        assert (tier.stats.errors, tier.last_error) == (1, "ConnectionError")
        tier.client = connect(redis_url, 2.0)  # Redis is back (same keys, another address)
        clock.now += tier.retry_seconds
        assert tier.put_many([(_h(0), FMT, _row(0))]) == 1
        assert tier.last_error == "" and tier.stats.errors == 1
    finally:
        tier.close()
