"""Where another process on the same node can map a tensor from: the one definition both the
model-runner (which owns the KV pool) and the offload-store (which maps it) use.

A handle is the ``SharedTensorHandle`` proto message as a frozen dataclass; the CUDA IPC wire
form is JSON with bytes as base64 (never pickle: a handle that arrives over RPC must not be
able to run code when decoded). torch is imported lazily so services that never map tensors
(the kv-cache-manager) do not import it through ``shared``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import InvalidArgument
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
