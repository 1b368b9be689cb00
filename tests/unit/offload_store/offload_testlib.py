"""Helpers and fixtures of the offload-store tests: shared-memory pool files, index databases.

NOTE: a uniquely named module rather than conftest.py, so tests can import its types without
clashing with the root tests/conftest.py (the test folders are not packages).

Pools are tiny (2 layers, 8 blocks of 4 tokens, 2 heads of dim 8: 1,024 bytes per fp32 block) so
budgets can be stated in whole blocks and eviction order asserted exactly.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, text

from services.offload_store.config import OffloadConfig
from services.offload_store.pool_mapping import PoolHandle
from services.offload_store.store import OffloadStore
from shared.tensor_handle import KIND_SHM_FILE

SHM_DIR = "/dev/shm"


@dataclass
class ShmPool:
    """A pool file in /dev/shm, mapped here as its own dtype and as bytes."""

    handle: PoolHandle
    raw: torch.Tensor  # [layers, 2, num_blocks, block_size, heads, head_dim * itemsize] uint8

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """A contiguous copy of one block's bytes."""
        return self.raw[:, :, block_id].clone()

    def fill_random(self, block_id: int, seed: int) -> torch.Tensor:
        """Writes seeded random bytes into a block; returns them."""
        gen = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, self.raw[:, :, block_id].shape, dtype=torch.uint8, generator=gen)
        self.raw[:, :, block_id].copy_(data)
        return data

    @property
    def block_nbytes(self) -> int:
        return self.raw[:, :, 0].numel()


PoolFactory = Callable[..., ShmPool]


@pytest.fixture
def make_pool() -> Iterator[PoolFactory]:
    """Creates pool files (unlinked at teardown)."""
    paths: list[str] = []

    def make(dtype: str = "float32", layers: int = 2, num_blocks: int = 8, block_size: int = 4,
             heads: int = 2, head_dim: int = 8) -> ShmPool:
        itemsize = getattr(torch, dtype).itemsize
        shape = (layers, 2, num_blocks, block_size, heads, head_dim)
        nbytes = math.prod(shape) * itemsize
        path = os.path.join(SHM_DIR, f"kvmesh-offload-test-{uuid.uuid4().hex}.kv")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        paths.append(path)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        raw = raw.view(layers, 2, num_blocks, block_size, heads, head_dim * itemsize)
        handle = PoolHandle(kind=KIND_SHM_FILE, dtype=dtype, shape=shape, nbytes=nbytes, path=path,
                            generation=uuid.uuid4().hex[:8])
        return ShmPool(handle, raw)

    yield make
    for path in paths:
        Path(path).unlink(missing_ok=True)


@dataclass(frozen=True)
class DbTarget:
    """An index database for one test: URL and a table nobody else uses."""

    kind: str  # "sqlite" | "postgres"
    url: str
    table: str


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, tmp_path: Path, postgres_url: str | None) -> Iterator[DbTarget]:
    """The index database, once SQLite in the test's tmp dir and once PostgreSQL (own table)."""
    if request.param == "sqlite":
        (tmp_path / "data").mkdir(exist_ok=True)
        yield DbTarget("sqlite", f"sqlite:///{tmp_path / 'data' / 'index.sqlite'}", "offload_blocks")
        return
    if postgres_url is None:
        pytest.skip("no PostgreSQL server answers at 127.0.0.1:5432 (users postgres, root)")
    table = f"offload_test_{uuid.uuid4().hex[:12]}"
    yield DbTarget("postgres", postgres_url, table)
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f'DROP TABLE IF EXISTS "{table}"'))
    engine.dispose()


CoreFactory = Callable[..., OffloadStore]


@pytest.fixture
def make_core(tmp_path: Path, db: DbTarget) -> Iterator[CoreFactory]:
    """Opens cores over ``<tmp>/data`` and the test's database; budgets in whole blocks."""
    cores: list[OffloadStore] = []

    def make(dram_blocks: int = 4, disk_blocks: int = 8, block_nbytes: int = 1024) -> OffloadStore:
        config = OffloadConfig(
            data_dir=str(tmp_path / "data"), db_url=db.url, db_table=db.table,
            dram_bytes=dram_blocks * block_nbytes, disk_bytes=disk_blocks * block_nbytes, pool_dir=SHM_DIR,
        )
        core = OffloadStore(config)
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.close()
