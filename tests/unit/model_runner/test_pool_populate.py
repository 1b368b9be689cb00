"""``pool_populate``: the CPU KV pool's sparse /dev/shm pages allocated up front, bytes unchanged.

The pool's file is the witness: tmpfs counts the pages it holds (``st_blocks``), so "allocated"
is exact, and the tensor's values before and after say nothing was written.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner
from services.model_runner.kv_pool import KVPool
from services.model_runner.pool_populate import populate, populate_in_background


def _pool() -> KVPool:
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, memory_bytes=1 << 20, dtype=torch.float32)


def _allocated(pool: KVPool) -> int:
    assert pool.path is not None
    return os.stat(pool.path).st_blocks * 512


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def test_a_new_pool_is_sparse_and_populate_allocates_every_page_without_writing() -> None:
    with _pool() as pool:
        assert _allocated(pool) == 0
        flat = pool.tensor.view(-1)
        flat[:5] = torch.tensor([1.0, -2.0, 3.5, 0.25, 7.0])  # the first page, written before
        flat[-1] = 42.0  # and the last
        assert _allocated(pool) == 2 * mmap.PAGESIZE
        before = pool.tensor.clone()
        assert populate(pool.tensor) >= 0.0
        assert _allocated(pool) == _pages(pool.nbytes)
        assert torch.equal(pool.tensor, before)
        assert flat[:5].tolist() == [1.0, -2.0, 3.5, 0.25, 7.0] and flat[-1].item() == 42.0


def test_the_background_thread_allocates_the_pool_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="services.model_runner.pool_populate")
    with _pool() as pool:
        thread = populate_in_background(pool.tensor, "KV pool test")
        assert thread.daemon and thread.name == "kvmesh-pool-populate"
        thread.join(30)
        assert not thread.is_alive()
        assert _allocated(pool) == _pages(pool.nbytes)
    logged = [r.getMessage().split(" in ")[0] for r in caplog.records]
    assert logged == [f"KV pool test: {pool.nbytes >> 20} MiB allocated"]


def test_a_failed_advice_is_an_os_error_and_a_warning_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="services.model_runner.pool_populate")
    assert populate(torch.empty(0)) >= 0.0  # no pages: nothing to advise, nothing raised
    # a shared mapping whose file was cut short: touching its last pages would SIGBUS, so the
    # kernel refuses to populate them with EFAULT (what a /dev/shm too small to hold a pool gives)
    path = f"/dev/shm/.kvmesh-populate-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4 * mmap.PAGESIZE)
        mapped = torch.from_file(path, shared=True, size=4 * mmap.PAGESIZE, dtype=torch.uint8)
        os.ftruncate(fd, mmap.PAGESIZE)
        with pytest.raises(OSError) as info:
            populate(mapped)
        assert info.value.errno == errno.EFAULT
        populate_in_background(mapped, "KV pool cut").join(30)
    finally:
        os.close(fd)
        os.unlink(path)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage() == (
        f"KV pool cut: could not allocate its pages up front ([Errno {errno.EFAULT}] Bad address); "
        "they are allocated as steps first write them")


def test_a_runner_built_on_the_cpu_allocates_its_whole_pool(tiny_llama_dir: Path) -> None:
    """The factory starts the population with the pool: no step of the runner pays a first touch
    (before, the file stayed sparse until steps wrote it: the slow first batch of docs/benchmarks.md)."""
    runner = build_runner(RunnerConfig(model_dir=str(tiny_llama_dir), device="cpu", warmup=False,
                                       kv_cache_memory_bytes=2 << 20))  # fmt: skip
    pool = runner.pool
    try:
        for thread in threading.enumerate():
            if thread.name == "kvmesh-pool-populate":
                thread.join(30)
        assert _allocated(pool) == _pages(pool.nbytes)
    finally:
        pool.close()
