"""The KV pool: sizing from a byte budget, the /dev/shm mapping, and attaching from elsewhere."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model_runner.kv_pool import (
    KVPool,
    SharedTensorHandle,
    attach,
    bytes_per_block,
    kv_dtype_for,
    remove_stale_pool_files,
)
from shared.errors import FailedPrecondition, InvalidArgument, NotFound

GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
FP32_BLOCK = 2 * 2 * 4 * 2 * 8 * 4  # layers * (K, V) * block_size * heads * head_dim * 4 bytes = 1024


def _pool(memory_bytes: int = 10 * FP32_BLOCK, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(**GEOMETRY, memory_bytes=memory_bytes, dtype=dtype)


def test_blocks_follow_the_budget() -> None:
    assert bytes_per_block(2, 4, 2, 8, torch.float32) == FP32_BLOCK
    with _pool(10 * FP32_BLOCK + 7) as pool:
        assert pool.num_blocks == 10
        assert pool.tensor.shape == (2, 2, 10, 4, 2, 8)
        assert pool.nbytes == 10 * FP32_BLOCK
        assert pool.kv_cache_dtype == "float32"


def test_fp8_holds_four_times_the_blocks_of_fp32() -> None:
    budget = 10 * FP32_BLOCK
    with _pool(budget) as fp32, _pool(budget, torch.float8_e4m3fn) as fp8:
        assert fp8.num_blocks == 4 * fp32.num_blocks
        assert fp8.tensor.dtype == torch.float8_e4m3fn
        assert fp8.kv_cache_dtype == "fp8_e4m3" and fp8.is_fp8
        assert fp8.scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_a_budget_below_two_blocks_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="at least 2"):
        _pool(2 * FP32_BLOCK - 1)


def test_kv_dtype_names() -> None:
    assert kv_dtype_for("auto", torch.bfloat16) == torch.bfloat16
    assert kv_dtype_for("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_dtype_for("int4", torch.float32) == torch.uint8  # packed rows with their scales
    with pytest.raises(InvalidArgument):
        kv_dtype_for("int8", torch.float32)


def test_file_lives_while_open_and_close_unlinks_it() -> None:
    pool = _pool()
    handle = pool.handle()
    assert handle.kind == "shm_file" and handle.path.startswith("/dev/shm/")
    assert handle.generation in handle.path
    assert os.path.getsize(handle.path) == pool.nbytes == handle.nbytes
    pool.close()
    assert not os.path.exists(handle.path)
    pool.close()  # idempotent
    with pytest.raises(FailedPrecondition):
        pool.handle()


_CHILD = """
import json, sys, torch
from services.model_runner.kv_pool import SharedTensorHandle, attach
fields = json.loads(sys.argv[1])
handle = SharedTensorHandle(**{**fields, "shape": tuple(fields["shape"]), "cuda_ipc_handle": b""})
pool = attach(handle)
seen = pool[1, 0, 3].float().sum().item()
pool[0, 1, 2, 1] = 7.0  # written here, read by the owner
print(json.dumps({"seen": seen}))
"""


def test_a_dropped_pool_unlinks_its_file() -> None:
    pool = _pool()
    path = pool.handle().path
    del pool
    assert not os.path.exists(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_another_process_shares_the_pool_both_ways(dtype: torch.dtype) -> None:
    with _pool(dtype=dtype) as pool:
        pool.tensor[1, 0, 3] = 0.5  # 4 * 2 * 8 = 64 elements -> sum 32 (0.5 is exact in fp8)
        fields = dataclasses.asdict(pool.handle())
        fields.pop("cuda_ipc_handle")
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(fields)],
            capture_output=True, text=True, check=True, timeout=120, cwd=Path(__file__).parents[3],
        )  # fmt: skip
        assert json.loads(out.stdout)["seen"] == 32.0
        assert (pool.tensor[0, 1, 2, 1].float() == 7.0).all()
        assert pool.tensor.float().sum().item() == 32.0 + 7.0 * 2 * 8  # the child's write: one token's [KV, D]


def test_attach_in_process_is_zero_copy() -> None:
    with _pool() as pool:
        view = attach(pool.handle())
        view[1, 1, 5] = 2.0
        assert (pool.tensor[1, 1, 5] == 2.0).all()
        pool.tensor[0, 0, 3] = 3.0
        assert (view[0, 0, 3] == 3.0).all()


def test_stale_handles_do_not_attach() -> None:
    pool = _pool()
    old = pool.handle()
    pool.close()
    with pytest.raises(NotFound):
        attach(old)
    with _pool() as regenerated:
        fresh = regenerated.handle()
        assert fresh.generation != old.generation
        with pytest.raises(NotFound):
            attach(old)  # the old generation's file is gone, whatever the new pool is
        with pytest.raises(FailedPrecondition):
            attach(dataclasses.replace(fresh, shape=(2, 2, 5, 4, 2, 8), nbytes=5 * FP32_BLOCK))
        with pytest.raises(InvalidArgument):
            attach(dataclasses.replace(fresh, shape=(2, 2, 9, 4, 2, 8)))
        with pytest.raises(InvalidArgument):
            attach(dataclasses.replace(fresh, dtype="float16"))
        with pytest.raises(InvalidArgument):
            attach(dataclasses.replace(fresh, kind="tcp"))
        with pytest.raises(InvalidArgument):
            attach(dataclasses.replace(fresh, dtype="not_a_dtype"))


def test_calibrate_sets_amax_over_448() -> None:
    with _pool(dtype=torch.float8_e4m3fn) as pool:
        pool.calibrate(torch.tensor([[4.48, 8.96], [0.0, 44.8]]))
        torch.testing.assert_close(pool.scales, torch.tensor([[0.01, 0.02], [1.0, 0.1]]))
        assert pool.layer_scales()[1] == (1.0, pytest.approx(0.1))
        with pytest.raises(InvalidArgument):
            pool.calibrate(torch.ones(3, 2))


def test_handle_fields_match_the_proto() -> None:
    with _pool() as pool:
        handle = pool.handle()
        assert isinstance(handle, SharedTensorHandle)
        assert handle.dtype == "float32" and handle.shape == (2, 2, 10, 4, 2, 8) and handle.device_index == -1


_SIGKILLED_RUNNER = """
import os, signal, sys, torch
from services.model_runner.kv_pool import KVPool
pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, memory_bytes=4096, dtype=torch.float32,
              shm_dir=sys.argv[1], name=sys.argv[2])
print(pool.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no finalizer: the file stays behind
"""


def test_a_sigkilled_runners_pool_file_is_removed_by_the_next_runner_not_a_live_ones(tmp_path: Path) -> None:
    """Issue 12 item 1: SIGKILL leaves the pool file in /dev/shm; the next runner's start removes it."""
    name = "kvmesh-kv-stale-test"
    shm = str(tmp_path)
    dead = subprocess.run([sys.executable, "-c", _SIGKILLED_RUNNER, shm, name], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[3])
    assert dead.returncode == -9
    dead_path = Path(dead.stdout.strip())
    assert dead_path.exists()
    unrelated = tmp_path / f"{name}-old-format.kv"  # another runner version's file: never touched
    unrelated.write_bytes(b"x")
    with KVPool(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, memory_bytes=4096, dtype=torch.float32,
                shm_dir=shm, name=name) as live:
        assert not dead_path.exists()
        assert live.path is not None and live.path.exists()
        assert remove_stale_pool_files(shm, name) == []  # the live runner holds its lock
        assert live.path.exists() and unrelated.exists()
    assert live.path is not None and not live.path.exists()
