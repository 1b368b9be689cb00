"""Maps the model-runner's KV pool into this process, zero-copy, from its shared handle.

The store only ever moves bytes, so every pool is mapped as ``uint8`` with the element bytes folded
into the last dimension::

    raw: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim * itemsize]  uint8
                         │
                         └─ raw[:, :, block_id] is one block: K and V of every layer

NOTE: mapping as bytes also sidesteps dtype support gaps (``torch.from_file`` and fp8): an fp8 pool
is a uint8 file to us, and the dtype name only decides which stored blocks it may receive.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass

import torch

from services.offload_store.types import BlockFormat
from shared.errors import FailedPrecondition, InvalidArgument
from shared.tensor_handle import (
    KIND_CUDA_IPC,
    KIND_SHM_FILE,
    SharedTensorHandle,
    decode_cuda_ipc,
    dtype_from_name,
)

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
    """Maps ``handle`` zero-copy after validating dtype, shape, size and (for files) location.

    Args:
        handle: the runner's handle.
        allowed_dir: the directory an ``shm_file`` handle must name a file in.

    Raises:
        InvalidArgument: malformed handle, or a file that does not match it.
        FailedPrecondition: a ``cuda_ipc`` handle in a process without CUDA.
    """
    dtype = dtype_from_name(handle.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = tuple(int(d) for d in handle.shape)
    if len(shape) != _POOL_RANK or shape[1] != 2 or min(shape) <= 0:
        raise InvalidArgument(
            f"pool shape must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], got {list(shape)}"
        )
    expected = math.prod(shape) * itemsize
    if handle.nbytes != expected:
        raise InvalidArgument(f"pool nbytes {handle.nbytes} != {expected} implied by shape and dtype")
    if handle.kind == KIND_SHM_FILE:
        flat = _map_shm_file(handle.path, handle.nbytes, allowed_dir)
    elif handle.kind == KIND_CUDA_IPC:
        flat = _map_cuda_ipc(handle.cuda_ipc_handle, handle.device_index, handle.nbytes)
    else:
        raise InvalidArgument(f"unsupported pool handle kind {handle.kind!r}")
    layers, _, num_blocks, block_size, heads, head_dim = shape
    raw = flat.view(layers, 2, num_blocks, block_size, heads, head_dim * itemsize)
    block_shape = (layers, 2, block_size, heads, head_dim)
    fmt = BlockFormat(str(dtype).removeprefix("torch."), block_shape, math.prod(block_shape) * itemsize)
    return MappedPool(handle=handle, raw=raw, block_format=fmt)


def _map_shm_file(path: str, nbytes: int, allowed_dir: str) -> torch.Tensor:
    if not os.path.isabs(path):
        raise InvalidArgument(f"pool path must be absolute, got {path!r}")
    real = os.path.realpath(path)
    root = os.path.realpath(allowed_dir)
    if os.path.dirname(real) != root:
        raise InvalidArgument(f"pool file {path!r} is not in the allowed directory {allowed_dir!r}")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise InvalidArgument(f"pool file {path!r} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"pool file {path!r} is not a regular file")
    if st.st_size != nbytes:
        raise InvalidArgument(f"pool file {path!r} holds {st.st_size} bytes, the handle says {nbytes}")
    # shared=True: MAP_SHARED, so our writes land in the runner's pool and no copy is made.
    return torch.from_file(real, shared=True, size=nbytes, dtype=torch.uint8)


def _map_cuda_ipc(data: bytes, device_index: int, nbytes: int) -> torch.Tensor:
    fields = decode_cuda_ipc(data)
    if not torch.cuda.is_available():
        raise FailedPrecondition("a cuda_ipc pool handle needs CUDA in the offload-store process")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(device_index, *fields)  # type: ignore[attr-defined]
    if storage.nbytes() < nbytes:
        raise InvalidArgument(f"shared CUDA storage holds {storage.nbytes()} bytes, the handle says {nbytes}")
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device_index}")
    return flat.set_(storage, 0, (nbytes,), (1,))
