"""Where another process on the same node can map a tensor from: the one definition both the
model-runner (which owns the KV pool) and the offload-store (which maps it) use.

A handle is the ``SharedTensorHandle`` proto message as a frozen dataclass; the CUDA IPC wire
form is JSON with bytes as base64 (never pickle: a handle that arrives over RPC must not be
able to run code when decoded). torch is imported lazily so services that never map tensors
(the kv-cache-manager) do not import it through ``shared``.

:func:`map_handle` is the one mapping of a handle: the model-runner's ``kv_pool.attach`` (typed
view) and the offload-store's ``pool_mapping.map_pool`` (byte view) both call it, so the same
fault is the same error (and the same gRPC status) wherever a handle is mapped.
"""

from __future__ import annotations

import base64
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import FailedPrecondition, InvalidArgument, NotFound
from shared.pb.kvmesh.v1 import common_pb2

if TYPE_CHECKING:
    import torch

KIND_SHM_FILE = "shm_file"
KIND_CUDA_IPC = "cuda_ipc"
_KIND_TO_PROTO = {
    KIND_SHM_FILE: common_pb2.SharedTensorHandle.KIND_SHM_FILE,
    KIND_CUDA_IPC: common_pb2.SharedTensorHandle.KIND_CUDA_IPC,
}
_KIND_FROM_PROTO = {v: k for k, v in _KIND_TO_PROTO.items()}


@dataclass(frozen=True)
class SharedTensorHandle:
    """A mappable tensor (mirrors the proto message).

    Attributes:
        kind: ``"shm_file"`` or ``"cuda_ipc"``.
        dtype: torch's name of the element type, e.g. ``"float32"``, ``"float8_e4m3fn"``.
        shape: tensor shape, outermost first.
        nbytes: bytes of the mapping.
        generation: unique per creation of the storage.
        path: the backing file (``shm_file``).
        cuda_ipc_handle: :func:`encode_cuda_ipc` bytes (``cuda_ipc``), opaque to callers.
        device_index: CUDA device owning the memory (``cuda_ipc``), -1 otherwise.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: str = ""
    path: str = ""
    cuda_ipc_handle: bytes = b""
    device_index: int = -1


def handle_to_proto(h: SharedTensorHandle) -> common_pb2.SharedTensorHandle:
    """The handle as its proto message."""
    if h.kind not in _KIND_TO_PROTO:
        raise InvalidArgument(f"unknown shared tensor kind {h.kind!r}")
    return common_pb2.SharedTensorHandle(
        kind=_KIND_TO_PROTO[h.kind], path=h.path, cuda_ipc_handle=h.cuda_ipc_handle, device_index=h.device_index,
        dtype=h.dtype, shape=list(h.shape), nbytes=h.nbytes, generation=h.generation,
    )


def handle_from_proto(msg: common_pb2.SharedTensorHandle) -> SharedTensorHandle:
    """A proto handle as the dataclass; ``InvalidArgument`` when its kind is unset or unknown."""
    kind = _KIND_FROM_PROTO.get(msg.kind)
    if kind is None:
        raise InvalidArgument("handle kind must be KIND_SHM_FILE or KIND_CUDA_IPC")
    return SharedTensorHandle(
        kind=kind, dtype=msg.dtype, shape=tuple(msg.shape), nbytes=msg.nbytes, generation=msg.generation,
        path=msg.path, cuda_ipc_handle=msg.cuda_ipc_handle, device_index=msg.device_index,
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name``, refusing anything that is not a real, storable dtype."""
    import torch

    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
        raise InvalidArgument(f"unknown dtype {name!r}")
    return dtype


# The fields of ``UntypedStorage._share_cuda_()`` after the device: bytes, ints, a bool, maybe None.
_IPC_FIELDS = (
    "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)


def encode_cuda_ipc(ipc: list[object]) -> bytes:
    """The wire form of ``storage._share_cuda_()[1:]`` (the device travels in ``device_index``)."""
    fields = {
        name: {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
        for name, v in zip(_IPC_FIELDS, ipc, strict=True)
    }
    return json.dumps(fields).encode()


def decode_cuda_ipc(raw: bytes) -> list[object]:
    """Inverse of :func:`encode_cuda_ipc`; ``InvalidArgument`` on anything malformed."""
    try:
        fields = json.loads(raw)
        return [base64.b64decode(v["b64"]) if isinstance(v, dict) else v for v in (fields[n] for n in _IPC_FIELDS)]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"malformed cuda_ipc_handle: {exc}") from None


def map_handle(handle: SharedTensorHandle, allowed_dir: str | None = None) -> torch.Tensor:
    """The memory ``handle`` names, mapped zero-copy here as a flat ``uint8`` tensor of ``nbytes``.

    Bytes, not the handle's dtype: ``torch.from_file`` has no fp8 path, and a caller that only
    moves bytes (the offload-store) never needs the elements; a typed view is one ``.view`` away.

    Args:
        handle: the owner's handle.
        allowed_dir: when set, the only directory a ``shm_file`` handle may name a file in (a
            handle that arrives over RPC must not point a writer at any other file).

    Raises:
        InvalidArgument: the handle itself is wrong, whatever exists on this node: unknown kind
            or dtype, ``nbytes`` not what shape and dtype imply, malformed CUDA IPC fields, a
            relative path, a path outside ``allowed_dir``, a path that is not a regular file.
        NotFound: the file it names does not exist (its pool was closed or re-created).
        FailedPrecondition: the memory is not the size the handle says, or a ``cuda_ipc`` handle
            reaches a process without CUDA.
    """

    dtype = dtype_from_name(handle.dtype)
    expected = math.prod(handle.shape) * dtype.itemsize
    if handle.nbytes != expected:
        raise InvalidArgument(f"handle nbytes {handle.nbytes} != {expected} implied by shape "
                              f"{list(handle.shape)} and dtype {handle.dtype}")
    if handle.kind == KIND_SHM_FILE:
        return _map_shm_file(handle.path, handle.nbytes, allowed_dir)
    if handle.kind == KIND_CUDA_IPC:
        return _map_cuda_ipc(handle.cuda_ipc_handle, handle.device_index, handle.nbytes)
    raise InvalidArgument(f"unknown shared tensor kind {handle.kind!r}")


def _map_shm_file(path: str, nbytes: int, allowed_dir: str | None) -> torch.Tensor:
    import torch

    if not os.path.isabs(path):
        raise InvalidArgument(f"shared tensor path must be absolute, got {path!r}")
    real = os.path.realpath(path)
    if allowed_dir is not None and os.path.dirname(real) != os.path.realpath(allowed_dir):
        raise InvalidArgument(f"shared tensor file {path!r} is not in the allowed directory {allowed_dir!r}")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise NotFound(f"shared tensor file {path!r} does not exist (closed or re-created pool)") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"shared tensor file {path!r} is not a regular file")
    if st.st_size != nbytes:
        raise FailedPrecondition(f"shared tensor file {path!r} holds {st.st_size} bytes, the handle says {nbytes}")
    # shared=True: MAP_SHARED, so writes land in the owner's memory and no copy is made.
    return torch.from_file(real, shared=True, size=nbytes, dtype=torch.uint8)


def _map_cuda_ipc(data: bytes, device_index: int, nbytes: int) -> torch.Tensor:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc = decode_cuda_ipc(data)
    if not torch.cuda.is_available():
        raise FailedPrecondition("a cuda_ipc handle needs CUDA in the mapping process")
    size_bytes = ipc[1]
    if not isinstance(size_bytes, int) or size_bytes < nbytes:
        raise FailedPrecondition(f"shared CUDA storage holds {size_bytes} bytes, the handle says {nbytes}")
    # torch's own consumer path: it caches the opened IPC handle, so mapping one storage twice in a
    # process (a re-attach) reuses the first mapping instead of opening the handle again.
    tensor: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor, (nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, device_index,
        ipc[0], ipc[1], ipc[2], False, ipc[3], ipc[4], ipc[5], ipc[6],
    )  # fmt: skip
    return tensor
