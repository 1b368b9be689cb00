"""Bulk copies of whole blocks between the mapped pool and contiguous byte rows.

A block is strided in the pool (``raw[:, :, block_id]`` is ``layers * 2`` runs of
``block_size * kv_heads * head_dim * itemsize`` bytes) and contiguous in a row, which is what a
file write, a file read and a checksum want.

NOTE: one ``copy_`` per block, on purpose. Measured on this machine class (SmolLM2-135M geometry,
128 blocks of 737,280 bytes): a per-block ``copy_`` runs at 10-15 GB/s, while the batched form
(``index_select`` on dim 2, then ``index_copy_`` into the rows) materialises an intermediate and
falls back to an element-wise kernel for the permuted layout: 0.4-2.2 GB/s. The Python overhead
of ~128 calls is a few percent of the copy time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.offload_store.pool_mapping import MappedPool


def copy_out(pool: MappedPool, block_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
    """Copies pool blocks into rows (each a contiguous ``[block_nbytes]`` uint8 tensor)."""
    shape = pool.raw[:, :, 0].shape
    for block_id, row in zip(block_ids, rows, strict=True):
        row.view(shape).copy_(pool.block(block_id), non_blocking=pool.is_cuda)
    if pool.is_cuda:  # the rows are read by the CPU (disk writes, checksums) right after
        torch.cuda.synchronize(pool.raw.device)


def copy_in(pool: MappedPool, block_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
    """Copies rows into pool blocks; the inverse of :func:`copy_out`."""
    shape = pool.raw[:, :, 0].shape
    for block_id, row in zip(block_ids, rows, strict=True):
        pool.block(block_id).copy_(row.view(shape), non_blocking=pool.is_cuda)
    if pool.is_cuda:  # the rows may be reused as soon as we return
        torch.cuda.synchronize(pool.raw.device)
