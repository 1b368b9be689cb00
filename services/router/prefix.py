"""A request's chained block hashes, computed exactly as its replica will compute them.

Three inputs must match the replica's: the hash seed (:func:`replica_hash_seed`), the tenant's
cache salt (:func:`shared.auth.tenant_cache_salt`, the same call the scheduler's servicer makes)
and the token ids (the replicas' tokenizer and chat template). The hashing itself is
:func:`shared.hashing.hash_blocks`, the one implementation every tier keys on.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.auth import tenant_cache_salt
from shared.hashing import BlockHash, hash_blocks, hash_seed


def replica_hash_seed(deployment_key: str, model_id: str) -> BlockHash:
    """The chain root a replica hashes with.

    NOTE: the one place the router knows who owns the seed: a replica's scheduler, which derives
    it from the deployment key (``KVMESH_DEPLOYMENT_KEY``) and the runner's model id (which the
    scheduler's GetModelInfo reports) and sends the hashes to its kv-cache-manager; nothing else
    in a replica hashes. The router derives it the same way from the same key. No replica API
    reveals its hashes of known tokens, so there is no connect-time check: a different key shows
    as ``router_matched_blocks`` staying 0 (docs/mesh.md).
    """
    return hash_seed(deployment_key.encode(), model_id)


def request_hashes(deployment_key: str, model_id: str, block_size: int, token_ids: Sequence[int],
                   tenant_id: str, client_salt: str = "") -> list[BlockHash]:
    """The hashes of the prompt's full blocks, salted for the tenant as the scheduler salts them."""
    salt = tenant_cache_salt(deployment_key, tenant_id, client_salt.encode())
    return hash_blocks(replica_hash_seed(deployment_key, model_id), token_ids, block_size, salt)
