"""The packed weights' huge-page arena (model/huge_pages.py): the same bytes, one aligned mapping."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model_runner.loader import load_model
from services.model_runner.model.huge_pages import (
    HUGE_PAGE,
    PAGE,
    move_to_huge_pages,
    release_free_heap,
    thp_available,
)
from services.model_runner.model.layers import Linear
from services.model_runner.model.native_layers import NativeDecoderModel
from services.model_runner.model.packed import NATIVE_MODES, PackedWeight
from services.model_runner.model.transforms import prepare_model
from services.model_runner.native import load_kernels


@dataclass
class Holder:
    packed: object


def _setting(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "enabled"
    path.write_text(text)
    return path


def test_tensors_move_into_one_aligned_arena_with_their_bytes(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randint(0, 255, (7000,), dtype=torch.uint8, generator=gen),
               torch.randn(48, 64, generator=gen).to(torch.bfloat16)]  # fmt: skip
    holders = [Holder(t.clone()) for t in tensors]
    handle = object()
    others = [Holder(handle), Holder(torch.empty(0))]
    arena = move_to_huge_pages(holders + others, _setting(tmp_path, "always [madvise] never\n"))
    assert isinstance(arena, mmap.mmap)
    moved = [h.packed for h in holders]
    for before, after in zip(tensors, moved, strict=True):
        assert isinstance(after, torch.Tensor)
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before)
    ptrs = [t.data_ptr() for t in moved if isinstance(t, torch.Tensor)]
    assert ptrs[0] % HUGE_PAGE == 0
    # one page-rounded slot each, in order: 60 bytes -> 1 page, 7,000 -> 2 pages
    assert [p - ptrs[0] for p in ptrs] == [0, PAGE, 3 * PAGE]
    assert others[0].packed is handle and others[1].packed.numel() == 0


def test_nothing_moves_where_huge_pages_are_off(tmp_path: Path) -> None:
    original = torch.randn(4, 4)
    holder = Holder(original)
    assert move_to_huge_pages([holder], _setting(tmp_path, "always madvise [never]\n")) is None
    assert holder.packed is original
    assert not thp_available(tmp_path / "missing")


@pytest.mark.skipif(load_kernels() is None, reason="needs the native CPU kernels")
def test_a_moved_weight_computes_the_same_bits(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(100, 64, generator=gen), torch.randn(5, 64, generator=gen)
    dense = PackedWeight(weight, None, "native")
    moved = PackedWeight(weight, None, "native")
    assert moved.mode in NATIVE_MODES
    before = moved.packed
    assert move_to_huge_pages([moved], _setting(tmp_path, "[always] madvise never\n")) is not None
    assert isinstance(moved.packed, torch.Tensor) and moved.packed.data_ptr() != before.data_ptr()  # type: ignore[union-attr]
    assert moved.packed.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(moved(x), dense(x))


@pytest.mark.skipif(load_kernels() is None or not thp_available(), reason="needs the native kernels and THP")
def test_prepare_model_packs_every_native_weight_into_the_arena_before_the_stack(checkpoint: Any) -> None:
    """prepare_model moves the weights before use_native_kernels, so the decode stack's addresses are
    the arena's: every packed tensor in one run of page-rounded slots from a 2 MB boundary."""
    kernels = load_kernels()
    model, _ = load_model(checkpoint("qwen2"))
    prepare_model(model, "none", kernels=kernels)
    packs = [m.packed for m in model.modules() if isinstance(m, Linear)] + [model.packed_head]
    tensors = [p.packed for p in packs if p is not None]
    assert len(tensors) == len([m for m in model.modules() if isinstance(m, Linear)]) + 1
    ptrs = [t.data_ptr() for t in tensors if isinstance(t, torch.Tensor)]
    assert len(ptrs) == len(tensors) and ptrs[0] % HUGE_PAGE == 0
    slots = [-(-t.nbytes // PAGE) * PAGE for t in tensors if isinstance(t, torch.Tensor)]
    assert [p - ptrs[0] for p in ptrs] == [sum(slots[:i]) for i in range(len(slots))]
    assert isinstance(model.model, NativeDecoderModel)


def test_the_freed_heap_is_handed_back_where_glibc_runs() -> None:
    """Linux with glibc (every machine this runs on): malloc_trim exists and is called."""
    assert release_free_heap() is True
