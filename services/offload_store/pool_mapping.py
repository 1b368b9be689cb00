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

import base64
import json
import math
import os
import stat
from dataclasses import dataclass

import torch

from services.offload_store.types import BlockFormat
from shared.errors import FailedPrecondition, InvalidArgument

KIND_SHM_FILE = "shm_file"
KIND_CUDA_IPC = "cuda_ipc"
_POOL_RANK = 6


@dataclass(frozen=True)
class PoolHandle:
    """Where to map a pool from (``SharedTensorHandle`` without protobuf).

    Attributes:
        kind: ``"shm_file"`` or ``"cuda_ipc"``.
        dtype: torch's name of the element type, e.g. ``"float16"``, ``"float8_e4m3fn"``.
        shape: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        nbytes: size of the mapping in bytes.
        path: for ``shm_file``, the absolute path of the backing file.
        cuda_ipc_handle: for ``cuda_ipc``, the bytes of :func:`encode_cuda_ipc`.
        device_index: for ``cuda_ipc``, the CUDA device owning the memory.
        generation: changes whenever the owner recreates the storage.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: str = ""
    cuda_ipc_handle: bytes = b""
    device_index: int = 0
    generation: str = ""


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


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name``, refusing anything that is not a real dtype name."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
        raise InvalidArgument(f"unknown pool dtype {name!r}")
    return dtype


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


# --- CUDA IPC -------------------------------------------------------------------------------------
# Wire form of ``UntypedStorage._share_cuda_()`` minus the device (which travels in device_index):
# JSON with bytes as base64, the form services/model_runner/kv_pool.py writes. Not pickle, so a
# handle from an RPC can never run code when decoded. NOTE: untested on this CPU-only machine.
_IPC_FIELDS = (
    "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)


def encode_cuda_ipc(tensor: torch.Tensor) -> bytes:
    """The ``cuda_ipc_handle`` bytes for ``tensor``'s storage (the owner must keep it alive)."""
    _device, *ipc = tensor.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    fields = {
        name: {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
        for name, v in zip(_IPC_FIELDS, ipc, strict=True)
    }
    return json.dumps(fields).encode()


def _decode_cuda_ipc(data: bytes) -> list[object]:
    try:
        fields = json.loads(data)
        return [base64.b64decode(v["b64"]) if isinstance(v, dict) else v for v in (fields[n] for n in _IPC_FIELDS)]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"malformed cuda_ipc_handle: {exc}") from None


def _map_cuda_ipc(data: bytes, device_index: int, nbytes: int) -> torch.Tensor:
    fields = _decode_cuda_ipc(data)
    if not torch.cuda.is_available():
        raise FailedPrecondition("a cuda_ipc pool handle needs CUDA in the offload-store process")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(device_index, *fields)  # type: ignore[attr-defined]
    if storage.nbytes() < nbytes:
        raise InvalidArgument(f"shared CUDA storage holds {storage.nbytes()} bytes, the handle says {nbytes}")
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device_index}")
    return flat.set_(storage, 0, (nbytes,), (1,))
