"""The model-runner's KV pool as this process sees it: a byte view over its shared handle.

The mapping itself is ``shared.tensor_handle.map_handle`` (the runner's ``kv_pool.attach`` maps
with it too, so a bad handle fails the same way on both sides); this module checks that the
handle names a pool and cuts the bytes into blocks.

The store only ever moves bytes, so every pool is mapped as ``uint8`` with the element bytes folded
into the last dimension::

    raw: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim * itemsize]  uint8
                         │
                         └─ raw[:, :, block_id] is one block: K and V of every layer

An MLA pool (docs/mla.md) has one plane where K and V have two, ``[layers, 1, blocks, block_size,
1, latent + rope]``; its blocks are cut the same way, and its block shape says so.

NOTE: mapping as bytes also sidesteps dtype support gaps (``torch.from_file`` and fp8): an fp8 pool
is a uint8 file to us, and the dtype name only decides which stored blocks it may receive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.offload_store.types import BlockFormat
from shared.errors import InvalidArgument
from shared.tensor_handle import SharedTensorHandle, dtype_from_name, dtype_name, map_handle

_POOL_RANK = 6


PoolHandle = SharedTensorHandle  # the offload-store's name for the shared handle type


@dataclass(frozen=True)
class MappedPool:
    """A mapped pool: the byte view, and what one block of it is."""

    handle: PoolHandle
    raw: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim * itemsize] uint8
    block_format: BlockFormat

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return int(self.raw.shape[2])

    @property
    def is_cuda(self) -> bool:
        """Whether the pool lives in GPU memory (DRAM buffers are then pinned)."""
        return self.raw.is_cuda

    def block(self, block_id: int) -> torch.Tensor:
        """One block's bytes, a strided view: ``[layers, 2, block_size, kv_heads, head_dim * itemsize]``."""
        return self.raw[:, :, block_id]

    def typed(self) -> torch.Tensor:
        """The pool in its own dtype and shape (a view; for tests and tools)."""
        dtype = dtype_from_name(self.block_format.dtype)
        return self.raw.view(-1).view(dtype).view(self.handle.shape)


def map_pool(handle: PoolHandle, allowed_dir: str) -> MappedPool:
    """Maps ``handle`` zero-copy after checking it names a pool (``shared.tensor_handle.map_handle``
    checks dtype, size and, for files, the location).

    Args:
        handle: the runner's handle.
        allowed_dir: the directory an ``shm_file`` handle must name a file in.

    Raises:
        InvalidArgument: not a pool's shape, or a malformed handle.
        NotFound: the pool file does not exist (the runner closed or re-created its pool).
        FailedPrecondition: memory of another size than the handle says, or a ``cuda_ipc`` handle
            in a process without CUDA.
    """
    shape = tuple(int(d) for d in handle.shape)
    if len(shape) != _POOL_RANK or shape[1] not in (1, 2) or min(shape) <= 0:
        raise InvalidArgument(
            f"pool shape must be [layers, 2 (K, V; 1 for MLA), num_blocks, block_size, kv_heads, head_dim], "
            f"got {list(shape)}"
        )
    flat = map_handle(handle, allowed_dir)
    dtype = dtype_from_name(handle.dtype)
    itemsize = dtype.itemsize
    layers, planes, num_blocks, block_size, heads, head_dim = shape
    raw = flat.view(layers, planes, num_blocks, block_size, heads, head_dim * itemsize)
    block_shape = (layers, planes, block_size, heads, head_dim)
    fmt = BlockFormat(dtype_name(dtype), block_shape, math.prod(block_shape) * itemsize)
    return MappedPool(handle=handle, raw=raw, block_format=fmt)
