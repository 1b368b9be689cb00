"""pool_mapping: zero-copy mapping of a pool file and the checks that refuse a bad handle."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from offload_testlib import SHM_DIR, PoolFactory

from services.model_runner.kv_pool import KVPool
from services.offload_store.pool_mapping import PoolHandle, map_pool
from shared.errors import FailedPrecondition, InvalidArgument, NotFound
from shared.tensor_handle import KIND_CUDA_IPC


def test_mapping_is_zero_copy_both_ways(make_pool: PoolFactory) -> None:
    pool = make_pool("float32")
    mapped = map_pool(pool.handle, SHM_DIR)
    pool.fill_random(3, seed=1)
    assert torch.equal(mapped.block(3), pool.raw[:, :, 3])
    mapped.block(5).fill_(0xAB)
    assert bool((pool.raw[:, :, 5] == 0xAB).all())
    assert mapped.raw.data_ptr() != pool.raw.data_ptr()  # two mappings, one memory


@pytest.mark.parametrize(
    ("dtype", "itemsize"), [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1)]
)
def test_geometry_and_format(make_pool: PoolFactory, dtype: str, itemsize: int) -> None:
    pool = make_pool(dtype, layers=3, num_blocks=5, block_size=4, heads=2, head_dim=8)
    mapped = map_pool(pool.handle, SHM_DIR)
    assert mapped.num_blocks == 5
    assert tuple(mapped.raw.shape) == (3, 2, 5, 4, 2, 8 * itemsize)
    assert mapped.block_format.dtype == dtype
    assert mapped.block_format.shape == (3, 2, 4, 2, 8)
    assert mapped.block_format.nbytes == 3 * 2 * 4 * 2 * 8 * itemsize
    typed = mapped.typed()
    assert typed.dtype == getattr(torch, dtype)
    assert tuple(typed.shape) == (3, 2, 5, 4, 2, 8)


@pytest.mark.parametrize("name", ["float64x", "complex64", "bool", "Tensor", "", "half.real"])
def test_unknown_dtype_is_refused(make_pool: PoolFactory, name: str) -> None:
    pool = make_pool("float32")
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        map_pool(dataclasses.replace(pool.handle, dtype=name), SHM_DIR)


def test_file_size_must_match(make_pool: PoolFactory) -> None:
    pool = make_pool("float32")
    os.truncate(pool.handle.path, pool.handle.nbytes - 1)
    with pytest.raises(FailedPrecondition, match=r"holds \d+ bytes, the handle says"):
        map_pool(pool.handle, SHM_DIR)


def test_nbytes_must_match_shape(make_pool: PoolFactory) -> None:
    pool = make_pool("float32")
    with pytest.raises(InvalidArgument, match="implied by shape"):
        map_pool(dataclasses.replace(pool.handle, nbytes=pool.handle.nbytes * 2), SHM_DIR)


@pytest.mark.parametrize("shape", [(2, 2, 8, 4, 2), (2, 3, 8, 4, 2, 8), (2, 2, 0, 4, 2, 8)])
def test_shape_must_be_a_pool(make_pool: PoolFactory, shape: tuple[int, ...]) -> None:
    pool = make_pool("float32")
    with pytest.raises(InvalidArgument, match="pool shape must be"):
        map_pool(dataclasses.replace(pool.handle, shape=shape), SHM_DIR)


def test_an_mla_pool_has_one_plane(tmp_path: Path) -> None:
    """An MLA runner's pool (``[layers, 1, blocks, block_size, 1, latent + rope]``) maps; a block is
    its one plane of every layer, and the block format says so."""
    with KVPool(num_layers=3, num_kv_heads=1, head_dim=40, block_size=4, memory_bytes=6 * 1920,
                dtype=torch.float32, shm_dir=SHM_DIR, name="kvmesh-kv-mla-test", planes=1) as pool:  # fmt: skip
        pool.tensor[:, 0, 2] = torch.arange(3 * 4 * 40, dtype=torch.float32).view(3, 4, 1, 40)
        mapped = map_pool(pool.handle(), SHM_DIR)
        assert mapped.block_format.shape == (3, 1, 4, 1, 40) and mapped.block_format.nbytes == 1920
        assert torch.equal(mapped.block(2).contiguous().view(torch.float32).view(3, 4, 1, 40), pool.tensor[:, 0, 2])


def test_file_outside_the_pool_dir_is_refused(make_pool: PoolFactory, tmp_path: Path) -> None:
    pool = make_pool("float32")
    outside = tmp_path / "pool.kv"
    outside.write_bytes(b"\0" * pool.handle.nbytes)
    with pytest.raises(InvalidArgument, match="not in the allowed directory"):
        map_pool(dataclasses.replace(pool.handle, path=str(outside)), SHM_DIR)
    with pytest.raises(InvalidArgument, match="must be absolute"):
        map_pool(dataclasses.replace(pool.handle, path="pool.kv"), SHM_DIR)
    sneaky = os.path.join(SHM_DIR, "..", str(outside).lstrip("/"))
    with pytest.raises(InvalidArgument, match="not in the allowed directory"):
        map_pool(dataclasses.replace(pool.handle, path=sneaky), SHM_DIR)


def test_missing_file_and_unknown_kind(make_pool: PoolFactory) -> None:
    pool = make_pool("float32")
    with pytest.raises(NotFound, match="does not exist"):
        map_pool(dataclasses.replace(pool.handle, path=pool.handle.path + ".gone"), SHM_DIR)
    with pytest.raises(InvalidArgument, match="unknown shared tensor kind"):
        map_pool(dataclasses.replace(pool.handle, kind="nfs"), SHM_DIR)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_ipc_without_cuda() -> None:
    handle = PoolHandle(kind=KIND_CUDA_IPC, dtype="float16", shape=(1, 2, 2, 4, 1, 8), nbytes=256,
                        cuda_ipc_handle=b"not json", device_index=0)
    with pytest.raises(InvalidArgument, match="malformed cuda_ipc_handle"):
        map_pool(handle, SHM_DIR)
    fields = (b'{"handle": {"b64": ""}, "size_bytes": 256, "offset_bytes": 0, "ref_counter_handle": '
              b'{"b64": ""}, "ref_counter_offset": 0, "event_handle": null, "event_sync_required": false}')
    with pytest.raises(FailedPrecondition, match="needs CUDA"):
        map_pool(dataclasses.replace(handle, cuda_ipc_handle=fields), SHM_DIR)
