"""The KV pool: one tensor holding every layer's paged K/V, shareable with other processes.

Layout (see ``attention/base.py`` and ``shared/kv_layout.py``)::

    [layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim]     block 0 = null block

A model whose layers all use full attention has one KV cache group of every layer, so the first
dimension is simply its layer count; a hybrid model (full and sliding-window layers) has several
groups of equally many layers, and layer ``l`` lives in slot ``j`` of its group
(``ModelConfig.kv_groups``): a block id then belongs to one group at a time, and one block id is
the same number of bytes in every group (docs/kv_layout.md).

The number of blocks follows from a byte budget. On the CPU the tensor is a ``/dev/shm`` file
mapped with ``torch.from_file(shared=True)``, so the offload-store can map the same pages
(zero copy) from a :class:`SharedTensorHandle`; on CUDA the handle carries a CUDA IPC handle of
the storage instead. Each creation gets a new ``generation`` (also in the file name), so a handle
to a closed or re-created pool fails to attach instead of mapping the wrong memory. The
generation is also the runner's *pool incarnation* (``ModelInfo.pool_id``): block ids and cached
KV mean something only within one (docs/reliability.md).

Stale files: ``close()`` (or interpreter exit) unlinks the file, but SIGKILL does not. Each runner
holds a shared ``flock`` on its file for its whole life (the kernel drops it when the process
dies, however it dies), so :func:`remove_stale_pool_files` — run before every CPU pool is
created — can tell a dead runner's file (lock free) from a live one's, even across containers
sharing ``/dev/shm``. The file is locked under a temporary name and then renamed into place, so
no cleaner ever sees an unlocked live file.

fp8 caches (``kv_cache_dtype="fp8_e4m3"``) hold ``K / k_scale`` and ``V / v_scale`` with one
pair of float32 scales per layer; :meth:`KVPool.calibrate` sets them from observed maxima.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import shutil
import uuid
import weakref
from pathlib import Path

import torch

from shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from shared.kv_layout import gqa_kv_bytes_per_token
from shared.tensor_handle import (
    SharedTensorHandle,
    dtype_from_name,
    dtype_name,
    encode_cuda_ipc,
    map_handle,
)

__all__ = ["FP8_NAME", "KVPool", "SharedTensorHandle", "attach", "bytes_per_block", "kv_dtype_for",
           "remove_stale_pool_files"]

log = logging.getLogger(__name__)
POOL_SUFFIX = ".kvpool"  # distinct from older runners' unlocked ".kv" files, which are never touched

FP8_NAME = "fp8_e4m3"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    FP8_NAME: torch.float8_e4m3fn,
}


def kv_dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"`` -> the model's dtype; ``"fp8_e4m3"``, ``"float16"``... -> that dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise InvalidArgument(f"kv_cache_dtype {kv_cache_dtype!r}: use auto or one of {sorted(_KV_DTYPES)}")
    return _KV_DTYPES[kv_cache_dtype]


def bytes_per_block(layer_slots: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block id, K and V: ``block_size`` tokens of the KV-size formula
    (``shared/kv_layout.py``) over the pool's ``layer_slots`` (``layers_per_group``: every layer
    for an all-full-attention model)."""
    return int(block_size * gqa_kv_bytes_per_token(layer_slots, num_kv_heads, head_dim, dtype.itemsize))


class KVPool:
    """Owns the pool tensor and its per-layer fp8 scales; ``close()`` releases the shared file."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        memory_bytes: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        shm_dir: str = "/dev/shm",
        name: str = "kvmesh-kv",
        layer_slots: int | None = None,
    ):
        """Allocates ``memory_bytes // bytes_per_block`` blocks (at least 2: block 0 is null).

        Args:
            num_layers: the model's layers (one pair of fp8 scales each).
            layer_slots: the pool's first dimension, ``layers_per_group(ModelConfig.kv_groups)``;
                default ``num_layers`` (one group of every layer).
            dtype: element type of the cache (``torch.float8_e4m3fn`` for fp8).
            shm_dir: memory-backed folder for the CPU mapping.
            name: file name prefix (the generation is appended).
        """
        self.dtype = dtype
        self.device = torch.device(device)
        self.shm_dir = shm_dir  # also the only folder a staging file of CopyBlocks may name
        self.block_size = block_size
        slots = num_layers if layer_slots is None else layer_slots
        self.bytes_per_block = bytes_per_block(slots, block_size, num_kv_heads, head_dim, dtype)
        self.num_blocks = memory_bytes // self.bytes_per_block
        if self.num_blocks < 2:
            raise InvalidArgument(
                f"a KV budget of {memory_bytes} bytes holds {self.num_blocks} blocks of "
                f"{self.bytes_per_block} bytes; at least 2 are needed (block 0 is the null block)"
            )
        self.shape = (slots, 2, self.num_blocks, block_size, num_kv_heads, head_dim)
        self.nbytes = self.num_blocks * self.bytes_per_block
        self.generation = uuid.uuid4().hex
        self.scales = torch.ones(num_layers, 2, dtype=torch.float32)  # [L, (k, v)]
        self.path: Path | None = None
        lock_fd = -1
        if self.device.type == "cpu":
            remove_stale_pool_files(shm_dir, name)
            self.path = Path(shm_dir) / f"{name}-{self.generation}{POOL_SUFFIX}"
            free = shutil.disk_usage(shm_dir).free
            if self.nbytes > free:
                raise ResourceExhausted(f"KV pool needs {self.nbytes} bytes, {shm_dir} has {free} free")
            lock_fd = _create_locked(self.path, self.nbytes)
            self.tensor = _map_file(self.path, self.shape, dtype)
        else:
            self.tensor = torch.zeros(self.shape, dtype=dtype, device=self.device)
        self._closed = False
        # NOTE: a pool dropped or left open at interpreter exit still unlinks its file, so crashed
        # tests and forgotten close() calls do not fill /dev/shm (SIGKILL leaks it until the next
        # runner's remove_stale_pool_files).
        self._unlink = weakref.finalize(self, _unlink, self.path, lock_fd)

    @property
    def kv_cache_dtype(self) -> str:
        """The name the rest of kvmesh uses: ``"fp8_e4m3"`` or the torch dtype's name."""
        return FP8_NAME if self.is_fp8 else dtype_name(self.dtype)

    @property
    def is_fp8(self) -> bool:
        """Whether K/V are stored scaled in float8_e4m3fn."""
        return self.dtype == torch.float8_e4m3fn

    def layer_scales(self) -> list[tuple[float, float]]:
        """``(k_scale, v_scale)`` per layer as Python floats (what the attention layers take)."""
        return [(float(k), float(v)) for k, v in self.scales.tolist()]

    def calibrate(self, amax: torch.Tensor) -> None:
        """Sets each scale to ``amax / 448``, so the largest value seen maps to fp8's largest.

        Args:
            amax: ``[num_layers, 2]`` max ``|K|`` / ``|V|`` per layer from a sample forward.
                Zero entries (nothing observed) keep scale 1.
        """
        if tuple(amax.shape) != tuple(self.scales.shape):
            raise InvalidArgument(f"amax must be {list(self.scales.shape)}, got {list(amax.shape)}")
        amax = amax.detach().float().cpu()
        self.scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))

    def handle(self) -> SharedTensorHandle:
        """How another process maps this pool; raises once the pool is closed."""
        if self._closed:
            raise FailedPrecondition("the KV pool is closed")
        common = {
            "dtype": dtype_name(self.dtype),
            "shape": self.shape,
            "nbytes": self.nbytes,
            "generation": self.generation,
        }
        if self.path is not None:
            return SharedTensorHandle(kind="shm_file", path=str(self.path), **common)  # type: ignore[arg-type]
        # NOTE: the IPC handle stays valid while this process keeps self.tensor alive.
        device, *ipc = self.tensor.untyped_storage()._share_cuda_()
        return SharedTensorHandle(
            kind="cuda_ipc",
            cuda_ipc_handle=encode_cuda_ipc(ipc),
            device_index=int(device),
            **common,  # type: ignore[arg-type]
        )

    def close(self) -> None:
        """Unlinks the shared file (mappings already made stay valid until dropped). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unlink()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(handle: SharedTensorHandle, allowed_dir: str | None = None) -> torch.Tensor:
    """Maps the tensor a handle names, zero copy, in this process, in its dtype and shape.

    The mapping is ``shared.tensor_handle.map_handle``'s (the offload-store maps pools with it
    too), so its errors are the same: NotFound for a closed or re-created pool's file,
    FailedPrecondition for a size the handle does not say, InvalidArgument for a malformed handle.
    A KVPool's file name carries its generation, so a stale handle names a file that is gone.
    ``allowed_dir``: the only folder an ``shm_file`` handle may name (set for handles from RPCs).
    """
    return map_handle(handle, allowed_dir).view(dtype_from_name(handle.dtype)).view(handle.shape)


def _unlink(path: Path | None, lock_fd: int = -1) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
    if lock_fd >= 0:
        os.close(lock_fd)  # drops the flock


def _create_locked(path: Path, nbytes: int) -> int:
    """Creates ``path`` (``nbytes``, zero-filled) holding a shared flock (the returned fd); locked
    before it gets its name."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


def remove_stale_pool_files(shm_dir: str, name: str = "kvmesh-kv") -> list[Path]:
    """Unlinks the pool files in ``shm_dir`` that no live runner holds (left by SIGKILL).

    Returns:
        The removed paths.
    """
    removed: list[Path] = []
    for path in sorted(Path(shm_dir).glob(f"{name}-*{POOL_SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live runner holds it
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d stale KV pool file(s) of dead runners: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def _map_file(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``shape`` tensor over the file at ``path`` (created zero-filled if missing), shared mapping."""
    numel = math.prod(shape)
    if dtype == torch.float8_e4m3fn:
        # NOTE: from_file has no fp8 path; map the bytes and reinterpret them.
        raw = torch.from_file(str(path), shared=True, size=numel, dtype=torch.uint8)
        return raw.view(dtype).view(shape)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


