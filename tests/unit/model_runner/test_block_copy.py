"""``block_copy.copy_blocks``: the CopyBlocksOut/In work, moved out of the servicer.

Block ``b`` of the pool is ``pool[:, :, b]``; staging row ``r`` is ``staging[r]``, the same
``[layers, 2, block_size, kv_heads, head_dim]`` values. Every bad request raises before anything
is copied.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.model_runner.block_copy import copy_blocks
from services.model_runner.kv_pool import KVPool, bytes_per_block
from shared.errors import InvalidArgument
from shared.tensor_handle import SharedTensorHandle, dtype_name

LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 2, 1, 4, 8
ROW = (LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[KVPool]:
    per_block = bytes_per_block(LAYERS, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    with KVPool(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                memory_bytes=NUM_BLOCKS * per_block, dtype=torch.float32, shm_dir=str(tmp_path)) as p:  # fmt: skip
        for b in range(NUM_BLOCKS):
            p.tensor[:, :, b] = torch.arange(math.prod(ROW), dtype=torch.float32).view(ROW) + 100 * b
        yield p


def _staging(tmp_path: Path, rows: int, dtype: torch.dtype = torch.float32,
             row: tuple[int, ...] = ROW) -> tuple[torch.Tensor, SharedTensorHandle]:  # fmt: skip
    shape = (rows, *row)
    path = tmp_path / f"staging-{rows}-{dtype_name(dtype)}-{len(row)}"
    tensor = torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    handle = SharedTensorHandle(kind="shm_file", dtype=dtype_name(dtype), shape=shape,
                                nbytes=math.prod(shape) * dtype.itemsize, path=str(path))  # fmt: skip
    return tensor, handle


def test_copy_out_puts_each_block_in_its_row(pool: KVPool, tmp_path: Path) -> None:
    staging, handle = _staging(tmp_path, 3)
    assert copy_blocks(pool, handle, [5, 2], [2, 0], into_pool=False) == 2 * pool.bytes_per_block == 256
    assert torch.equal(staging[2], pool.tensor[:, :, 5]) and torch.equal(staging[0], pool.tensor[:, :, 2])
    assert torch.equal(staging[1], torch.zeros(ROW))  # untouched
    # layer 1, K, slot 1, head 0, dim 3 of block 5: the row keeps the pool's element order
    assert staging[2, 1, 0, 1, 0, 3].item() == 500 + (((1 * 2 + 0) * 2 + 1) * 1 + 0) * 4 + 3


def test_copy_in_writes_only_the_named_blocks(pool: KVPool, tmp_path: Path) -> None:
    staging, handle = _staging(tmp_path, 2)
    staging[1] = -7.0
    before = pool.tensor.clone()
    assert copy_blocks(pool, handle, [3], [1], into_pool=True) == pool.bytes_per_block
    assert torch.equal(pool.tensor[:, :, 3], torch.full(ROW, -7.0))
    others = [b for b in range(NUM_BLOCKS) if b != 3]
    assert torch.equal(pool.tensor[:, :, others], before[:, :, others])


@pytest.mark.parametrize(("ids", "rows", "message"), [
    ([2, 3], [0], "staging_rows: must have one row per block id"),
    ([0], [0], r"block_ids: must lie in \[1, 8\)"),  # the null block is never copied
    ([NUM_BLOCKS], [0], r"block_ids: must lie in \[1, 8\)"),
    ([2], [2], r"staging_rows: must lie in \[0, 2\)"),
    ([2], [-1], r"staging_rows: must lie in \[0, 2\)"),
])  # fmt: skip
def test_bad_ids_or_rows_copy_nothing(pool: KVPool, tmp_path: Path, ids: list[int], rows: list[int],
                                      message: str) -> None:  # fmt: skip
    staging, handle = _staging(tmp_path, 2)
    staging.fill_(3.0)
    before = pool.tensor.clone()
    for into_pool in (True, False):
        with pytest.raises(InvalidArgument, match=message):
            copy_blocks(pool, handle, ids, rows, into_pool=into_pool)
    assert torch.equal(pool.tensor, before) and torch.equal(staging, torch.full_like(staging, 3.0))


@pytest.mark.parametrize(("dtype", "row"), [
    (torch.float16, ROW),  # another dtype
    (torch.float32, (LAYERS, 2, BLOCK * 2, KV_HEADS, HEAD_DIM)),  # another block size
    (torch.float32, (LAYERS + 1, 2, BLOCK, KV_HEADS, HEAD_DIM)),  # another layer count
])  # fmt: skip
def test_a_staging_tensor_of_another_geometry_is_refused(pool: KVPool, tmp_path: Path, dtype: torch.dtype,
                                                          row: tuple[int, ...]) -> None:  # fmt: skip
    _, handle = _staging(tmp_path, 2, dtype, row)
    before = pool.tensor.clone()
    with pytest.raises(InvalidArgument, match="staging: shape or dtype does not match the pool's blocks"):
        copy_blocks(pool, handle, [2], [0], into_pool=True)
    assert torch.equal(pool.tensor, before)


def test_staging_outside_the_pools_folder_is_refused_and_untouched(pool: KVPool, tmp_path: Path) -> None:
    """A handle arrives over RPC: it must not point the runner's writes (or reads) at any file."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    staging, handle = _staging(elsewhere, 2)
    staging.fill_(3.0)
    before = pool.tensor.clone()
    for into_pool in (False, True):
        with pytest.raises(InvalidArgument, match="not in the allowed directory"):
            copy_blocks(pool, handle, [2], [0], into_pool=into_pool)
    assert torch.equal(pool.tensor, before) and torch.equal(staging, torch.full_like(staging, 3.0))


def test_an_mla_pool_copies_its_one_plane(tmp_path: Path) -> None:
    """An MLA pool (``planes=1``: one latent row per token and layer) copies blocks of
    ``[layers, 1, block_size, 1, latent + rope]``; a K/V-shaped staging row is refused."""
    row = (LAYERS, 1, BLOCK, 1, 12)
    per_block = bytes_per_block(LAYERS, BLOCK, 1, 12, torch.float32, planes=1)
    assert per_block == LAYERS * BLOCK * 12 * 4
    with KVPool(num_layers=LAYERS, num_kv_heads=1, head_dim=12, block_size=BLOCK, memory_bytes=NUM_BLOCKS * per_block,
                dtype=torch.float32, shm_dir=str(tmp_path), planes=1) as mla:  # fmt: skip
        mla.tensor[:, :, 4] = torch.arange(math.prod(row), dtype=torch.float32).view(row)
        staging, handle = _staging(tmp_path, 2, row=row)
        assert copy_blocks(mla, handle, [4], [1], into_pool=False) == per_block
        assert torch.equal(staging[1], mla.tensor[:, :, 4])
        assert copy_blocks(mla, handle, [6], [1], into_pool=True) == per_block
        assert torch.equal(mla.tensor[:, :, 6], mla.tensor[:, :, 4])
        _, kv_shaped = _staging(tmp_path, 2, row=(LAYERS, 2, BLOCK, 1, 6))
        with pytest.raises(InvalidArgument, match="shape or dtype does not match"):
            copy_blocks(mla, kv_shaped, [4], [0], into_pool=False)


def test_a_bf16_pool_copies_out_and_back_byte_for_byte(tmp_path: Path) -> None:
    """bf16 mode's pool: 2-byte elements, half the fp32 block's bytes; a block copied out and into
    another block arrives bit for bit (the offload store moves raw bytes)."""
    per_block = bytes_per_block(LAYERS, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16)
    with KVPool(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                memory_bytes=NUM_BLOCKS * per_block, dtype=torch.bfloat16, shm_dir=str(tmp_path)) as p:  # fmt: skip
        assert p.bytes_per_block * 2 == bytes_per_block(LAYERS, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
        p.tensor[:, :, 4] = torch.randn(ROW, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        staging, handle = _staging(tmp_path, 2, torch.bfloat16)
        assert copy_blocks(p, handle, [4], [1], into_pool=False) == p.bytes_per_block
        assert torch.equal(staging[1].view(torch.int16), p.tensor[:, :, 4].view(torch.int16))
        assert copy_blocks(p, handle, [6], [1], into_pool=True) == p.bytes_per_block
        assert torch.equal(p.tensor[:, :, 6].view(torch.int16), p.tensor[:, :, 4].view(torch.int16))
        _, fp32_handle = _staging(tmp_path, 2, torch.float32)
        with pytest.raises(InvalidArgument, match="shape or dtype does not match"):
            copy_blocks(p, fp32_handle, [4], [0], into_pool=False)
