"""Chained block hashes: determinism, chaining, salt and seed separation."""

from __future__ import annotations

import hashlib
import struct

import pytest

from shared.hashing import hash_block, hash_blocks, hash_seed

SEED = hash_seed(b"key", "model-a")


def test_known_vector() -> None:
    """Pins the encoding: changing it silently would orphan every stored offload block."""
    seed = hash_seed(b"", "m")
    expected_seed = hashlib.sha256(b"kvmesh/v1/block-hash-seed\x00" + struct.pack("<I", 0) + b"m").digest()
    assert seed == expected_seed
    tokens = [1, 2, 3, 4]
    h = hash_blocks(seed, tokens, 4)[0]
    assert h == hashlib.sha256(seed + struct.pack("<I", 0) + struct.pack("<4i", *tokens)).digest()


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(SEED, list(range(55)), 16)) == 3
    assert hash_blocks(SEED, list(range(15)), 16) == []


def test_chain_matches_single_block_function() -> None:
    tokens = list(range(48))
    chain = hash_blocks(SEED, tokens, 16, b"salt")
    assert chain[0] == hash_block(SEED, tokens[:16], b"salt")
    assert chain[1] == hash_block(chain[0], tokens[16:32])
    assert chain[2] == hash_block(chain[1], tokens[32:48])


def test_incremental_equals_full() -> None:
    tokens = list(range(100))
    full = hash_blocks(SEED, tokens, 16, b"s")
    head = hash_blocks(SEED, tokens[:40], 16, b"s")
    tail = hash_blocks(SEED, tokens, 16, b"s", start_block=len(head), parent=head[-1])
    assert head + tail == full


def test_prefix_sharing_and_divergence() -> None:
    a = hash_blocks(SEED, list(range(32)), 16)
    b = hash_blocks(SEED, [*range(16), *range(100, 116)], 16)
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_salt_enters_first_block_and_so_every_block() -> None:
    tokens = list(range(32))
    plain = hash_blocks(SEED, tokens, 16)
    salted = hash_blocks(SEED, tokens, 16, b"tenant-1")
    assert plain[0] != salted[0] and plain[1] != salted[1]


def test_seed_separates_models_and_deployments() -> None:
    tokens = list(range(16))
    base = hash_blocks(SEED, tokens, 16)
    assert hash_blocks(hash_seed(b"key", "model-b"), tokens, 16) != base
    assert hash_blocks(hash_seed(b"other", "model-a"), tokens, 16) != base


def test_parent_required_past_first_block() -> None:
    with pytest.raises(ValueError):
        hash_blocks(SEED, list(range(32)), 16, start_block=1)
