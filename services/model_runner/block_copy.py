"""Copies whole KV blocks between the runner's pool and a staging tensor another process shares.

The offload store swaps blocks through a staging tensor of rows, one block per row::

    staging: [n, num_layers, planes, block_size, kv_heads, head_dim]   (row r = one block)
    pool:    [num_layers, planes, num_blocks, block_size, kv_heads, head_dim]   (planes: 2, 1 for MLA)

Everything is checked before anything is copied, so a bad request changes nothing. It is the
``CopyBlocksOut`` / ``CopyBlocksIn`` RPCs' work, kept out of the servicer (which only converts and
runs it on the runner's compute thread, between steps: the pool is shared with the forward pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.model_runner.kv_pool import KVPool, attach
from shared.errors import InvalidArgument
from shared.tensor_handle import SharedTensorHandle


def copy_blocks(
    pool: KVPool,
    staging: SharedTensorHandle,
    block_ids: Sequence[int],
    rows: Sequence[int],
    *,
    into_pool: bool,
) -> int:
    """Copies pool block ``block_ids[i]`` to or from staging row ``rows[i]``.

    Args:
        pool: the runner's pool.
        staging: the other process's staging tensor (mapped here, zero-copy for shm files).
        block_ids: pool blocks, never the null block 0.
        rows: one staging row per block id.
        into_pool: True copies staging rows into the pool, False pool blocks into the rows.

    Returns:
        The bytes copied (``len(block_ids) * pool.bytes_per_block``).

    Raises:
        InvalidArgument: mismatched lengths, an id or row out of range, a staging file outside
            the pool's shm folder, or a staging tensor whose blocks are not the pool's shape and
            dtype; nothing was copied.
    """
    ids, rows = list(block_ids), list(rows)
    if len(ids) != len(rows):
        raise InvalidArgument("staging_rows: must have one row per block id")
    if any(not 0 < b < pool.num_blocks for b in ids):
        raise InvalidArgument(f"block_ids: must lie in [1, {pool.num_blocks})")
    # NOTE: the handle arrives over RPC: confined to the pool's own shm folder, it cannot point the
    # runner's writes (CopyBlocksOut) or reads (CopyBlocksIn) at any other file on the node.
    tensor = attach(staging, pool.shm_dir)
    if tuple(tensor.shape[1:]) != (*pool.shape[:2], *pool.shape[3:]) or tensor.dtype != pool.tensor.dtype:
        raise InvalidArgument("staging: shape or dtype does not match the pool's blocks")
    if any(not 0 <= r < tensor.shape[0] for r in rows):
        raise InvalidArgument(f"staging_rows: must lie in [0, {tensor.shape[0]})")
    idx = torch.tensor(ids, dtype=torch.long, device=pool.tensor.device)
    ridx = torch.tensor(rows, dtype=torch.long, device=tensor.device)
    if into_pool:
        pool.tensor.index_copy_(2, idx, tensor.index_select(0, ridx).permute(1, 2, 0, 3, 4, 5)
                                .to(pool.tensor.device))  # fmt: skip
    else:
        tensor.index_copy_(0, ridx, pool.tensor.index_select(2, idx).permute(2, 0, 1, 3, 4, 5)
                           .to(tensor.device))  # fmt: skip
    return len(ids) * pool.bytes_per_block
