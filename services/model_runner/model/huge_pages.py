"""One arena of transparent huge pages for the packed weights.

Why: a decode step streams every packed weight from memory once, panel after panel. On 4 KB pages
a step's weights (270 MB in bf16 mode for SmolLM2-135M, 540 MB in fp32) are far past what the TLB
covers, so every panel's pages miss it again on every step; 2 MB pages need 512 times fewer
entries. It pays most where the weights' stream is the step (a single-stream decode); the
measurements: docs/model_runner.md, "Huge pages".

What: after packing, each native weight's tensor is copied into one private anonymous mapping
advised ``MADV_HUGEPAGE`` and replaced by a view of it, one weight at a time (the copy it replaces
is freed as it goes, so the peak is the weights plus one, and the freed heap is then handed back:
:func:`release_free_heap`). Each tensor starts on a 4 KB page; the
arena starts on a 2 MB boundary. The bytes are the same at another address, so no result changes.
Where the kernel's transparent huge pages are off (``never``) or Python's ``mmap`` lacks
``madvise``, nothing moves.

NOTE: the KV pool is not here: it is a ``/dev/shm`` file the offload-store maps (zero copy), and
shared memory gets huge pages only where the operator mounts it so (docs/model_runner.md).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

HUGE_PAGE = 2 << 20
PAGE = 4096
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class HoldsPacked(Protocol):
    """What :func:`move_to_huge_pages` moves: an object whose ``packed`` is a tensor (a PackedWeight)."""

    packed: object


def thp_available(setting: Path = THP_SETTING) -> bool:
    """Whether the kernel grants transparent huge pages to a mapping that asks (``always`` or
    ``madvise``) and this Python can ask."""
    try:
        text = setting.read_text()
    except OSError:
        return False
    return "[never]" not in text and hasattr(mmap, "MADV_HUGEPAGE")


def move_to_huge_pages(owners: Sequence[HoldsPacked], setting: Path = THP_SETTING) -> mmap.mmap | None:
    """Moves each owner's ``packed`` tensor into one huge-page arena (see the module docstring).

    Args:
        owners: objects whose ``packed`` is a CPU tensor; others (oneDNN / fbgemm handles, empty
            tensors) are left where they are.
        setting: the kernel's THP setting (a parameter for tests).

    Returns:
        The arena (the views keep it alive too), or None when nothing moved.
    """
    # owners and their slots only: holding the tensors here would keep every replaced copy alive
    movable: list[tuple[HoldsPacked, int]] = []
    for owner in owners:
        packed = owner.packed
        if isinstance(packed, torch.Tensor) and packed.numel() > 0 and packed.device.type == "cpu":
            movable.append((owner, -(-packed.nbytes // PAGE) * PAGE))
    if not movable or not thp_available(setting):
        return None
    arena = mmap.mmap(-1, sum(size for _, size in movable) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    offset = (-ctypes.addressof(ctypes.c_char.from_buffer(arena))) % HUGE_PAGE
    for owner, size in movable:
        packed = owner.packed
        assert isinstance(packed, torch.Tensor)  # as filtered above
        tensor = packed.contiguous()
        view = torch.frombuffer(arena, dtype=torch.uint8, count=tensor.nbytes, offset=offset)
        view = view.view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        owner.packed = view
        offset += size
    release_free_heap()
    return arena


def release_free_heap() -> bool:
    """Hands the heap's free memory back to the kernel (glibc's ``malloc_trim``); False where the C
    library has none.

    Why: the copies the arena replaces were allocated from the heap (once a few large blocks have
    been freed, glibc serves blocks of that size from the heap instead of fresh mappings), and free
    blocks below live ones stay resident until trimmed: without this the runner kept about the
    weights' size again (docs/model_runner.md, "Huge pages")."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True

