"""Chained SHA-256 prefix hashes of full KV blocks.

A block's hash covers its parent's hash, its token ids and (first block only) extra keys such as
the per-request cache salt, so equal hashes mean equal prefixes, not merely equal blocks::

    seed ──▶ h0 = H(seed, salt, tokens[0:16]) ──▶ h1 = H(h0, tokens[16:32]) ──▶ h2 = ...

The seed is derived from a deployment key and the model identity: two deployments or two models
never produce the same hashes. In a replica the scheduler is the one caller: it hashes each
request once and sends the hashes to the kv-cache-manager (prefix map) and the offload-store
(keys); the router calls it with the same seed derivation to predict them.

NOTE: encoding is fixed-width and length-prefixed (32-byte parent, 4-byte extra length, int32
little-endian tokens), so no two different inputs share an encoding.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

HASH_BYTES = 32
_SEED_DOMAIN = b"kvmesh/v1/block-hash-seed\x00"
_EMPTY = struct.pack("<I", 0)
_sha256 = hashlib.sha256
_collide = False  # test hook, see force_collisions


def force_collisions(on: bool = True) -> None:
    """TEST HOOK: hash blocks without their token ids, so equal-length prefixes collide.

    Lets a test prove that a hash hit is never trusted alone: the kv-cache-manager compares the
    block's token ids and must turn such a collision into a miss (never another prompt's KV).
    Only tests call it (tests/unit/scheduler/test_hash_collision.py); no service reads a switch.
    """
    global _collide
    _collide = on


def hash_seed(deployment_key: bytes, model_id: str) -> BlockHash:
    """The chain's root: distinct for every (deployment key, model) pair."""
    model = model_id.encode()
    payload = _SEED_DOMAIN + struct.pack("<I", len(deployment_key)) + deployment_key + model
    return BlockHash(_sha256(payload).digest())


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("i", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 32-bit int
        raise RuntimeError("array('i') is not 32-bit on this platform")
    return arr.tobytes()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (or the seed for the first block)."""
    head = parent + struct.pack("<I", len(extra)) + extra if extra else parent + _EMPTY
    return BlockHash(_sha256(head + (b"" if _collide else _token_bytes(token_ids))).digest())


def hash_blocks(
    seed: bytes,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: bytes = b"",
    *,
    start_block: int = 0,
    parent: bytes | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    Args:
        seed: the chain root from :func:`hash_seed`.
        token_ids: every token of the sequence (from its start).
        block_size: tokens per block; a trailing partial block is not hashed.
        cache_salt: extra key mixed into the first block only.
        start_block: first block to hash; ``parent`` must then be block ``start_block - 1``'s hash.
        parent: hash of the block before ``start_block`` (ignored when it is 0).

    Returns:
        One hash per full block from ``start_block``.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return []
    if start_block == 0:
        prev = seed
    elif parent is None:
        raise ValueError("parent is required when start_block > 0")
    else:
        prev = parent
    data = _token_bytes(token_ids[start_block * block_size : num_full * block_size])
    step = block_size * 4
    out: list[BlockHash] = []
    salt_head = struct.pack("<I", len(cache_salt)) + cache_salt
    for i in range(num_full - start_block):
        chunk = b"" if _collide else data[i * step : (i + 1) * step]
        if start_block + i == 0:
            digest = _sha256(prev + salt_head + chunk).digest()
        else:
            digest = _sha256(prev + _EMPTY + chunk).digest()
        out.append(BlockHash(digest))
        prev = digest
    return out
