"""OffloadStore end to end over a real /dev/shm pool, a real data dir and a real index
(SQLite and PostgreSQL): round trips, tiers, lookups, data faults, bad input, restarts."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from pathlib import Path

import pytest
import torch
from offload_testlib import CoreFactory, DbTarget, PoolFactory, ShmPool

from services.offload_store.disk_tier import ReconcileReport
from services.offload_store.store import OffloadStore
from services.offload_store.types import LoadResult, LookupResult, OffloadStats, SaveResult
from shared.errors import FailedPrecondition, InvalidArgument
from shared.hashing import BlockHash, hash_blocks, hash_seed

BLOCK = 1024  # bytes of one block of the default fp32 test pool


def chain(n: int, salt: bytes = b"") -> list[BlockHash]:
    """n real chained block hashes."""
    return hash_blocks(hash_seed(b"test", "tiny"), list(range(n * 4)), 4, salt)


def fill(pool: ShmPool, block_ids: list[int]) -> list[torch.Tensor]:
    return [pool.fill_random(b, seed=100 + b) for b in block_ids]


def counters(core: OffloadStore) -> tuple[int, int, int, int, int]:
    s = core.stats()
    return s.dram_hits, s.disk_hits, s.misses, s.saves, s.corruptions


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("dram_blocks", [4, 0], ids=["dram", "disk-only"])
def test_save_load_round_trip_is_bytes_identical(make_core: CoreFactory, make_pool: PoolFactory,
                                                 dtype: str, dram_blocks: int) -> None:
    pool = make_pool(dtype)
    core = make_core(dram_blocks=dram_blocks, block_nbytes=pool.block_nbytes)
    assert core.attach_pool(pool.handle) == pool.block_nbytes
    hashes = chain(3)
    saved = fill(pool, [1, 2, 3])
    assert core.save(list(zip(hashes, [1, 2, 3], strict=True))) == SaveResult(3, 0)
    pool.raw[:, :, 4:7].zero_()
    assert core.load(list(zip(hashes, [4, 5, 6], strict=True))) == LoadResult(3, [])
    for block_id, expected in zip([4, 5, 6], saved, strict=True):
        assert torch.equal(pool.block_bytes(block_id), expected)
    assert torch.equal(pool.raw[:, :, 7], torch.zeros_like(pool.raw[:, :, 7]))  # nothing else written
    hits = (3, 0) if dram_blocks else (0, 3)
    assert counters(core) == (*hits, 0, 3, 0)
    s = core.stats()
    assert (s.dram_blocks, s.disk_blocks) == ((3, 0) if dram_blocks else (0, 3))


def test_saving_a_held_hash_is_skipped(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    pool = make_pool()
    core = make_core()
    core.attach_pool(pool.handle)
    hashes = chain(2)
    fill(pool, [1, 2])
    assert core.save([(hashes[0], 1)]) == SaveResult(1, 0)
    assert core.save([(hashes[0], 1), (hashes[1], 2), (hashes[1], 2)]) == SaveResult(1, 2)
    assert core.stats().saves == 2


def test_lookup_is_the_longest_leading_run(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    pool = make_pool()
    core = make_core(dram_blocks=2, disk_blocks=8)
    core.attach_pool(pool.handle)
    h = chain(5)
    fill(pool, [1, 2, 3, 4])
    core.save([(h[0], 1), (h[1], 2), (h[3], 4)])  # h0 is demoted to disk by h3
    assert core.lookup(h) == LookupResult(num_present=2, num_in_dram=1)
    assert core.lookup(h[1:2]) == LookupResult(1, 1)
    assert core.lookup(h[2:]) == LookupResult(0, 0)
    assert core.lookup([]) == LookupResult(0, 0)
    core.save([(h[2], 3)])  # h1 demoted now
    assert core.lookup(h) == LookupResult(4, 2)
    assert core.lookup(chain(5, salt=b"other tenant")) == LookupResult(0, 0)
    assert counters(core) == (0, 0, 0, 4, 0)  # a lookup is not a hit or a miss


def test_dram_eviction_demotes_and_a_disk_hit_is_promoted(make_core: CoreFactory, make_pool: PoolFactory,
                                                          tmp_path: Path) -> None:
    pool = make_pool()
    core = make_core(dram_blocks=2, disk_blocks=8)
    core.attach_pool(pool.handle)
    h = chain(3)
    data = fill(pool, [1, 2, 3])
    core.save([(h[0], 1), (h[1], 2), (h[2], 3)])
    s = core.stats()
    assert (s.dram_blocks, s.dram_bytes, s.disk_blocks, s.disk_bytes) == (2, 2 * BLOCK, 1, BLOCK)
    assert (tmp_path / "data" / "blocks" / h[0][:1].hex() / f"{h[0].hex()}.kv").read_bytes() == \
        data[0].numpy().tobytes()
    # h0 comes from disk and is promoted (evicting h1, the LRU, to disk); h2 is a DRAM hit
    assert core.load([(h[0], 5), (h[2], 6)]) == LoadResult(2, [])
    assert counters(core) == (1, 1, 0, 3, 0)
    assert core.lookup(h) == LookupResult(3, 2)
    assert core.lookup(h[1:]) == LookupResult(2, 1)  # h1 went to disk
    assert core.stats().disk_blocks == 2  # tiers are inclusive: h0 is still on disk too
    assert torch.equal(pool.block_bytes(5), data[0]) and torch.equal(pool.block_bytes(6), data[2])


def test_a_load_never_evicts_its_own_later_blocks(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    """Promoting h0 would push out h1, needed next: h0 is served from disk without promotion."""
    pool = make_pool()
    core = make_core(dram_blocks=2, disk_blocks=8)
    core.attach_pool(pool.handle)
    h = chain(3)
    data = fill(pool, [1, 2, 3])
    core.save([(h[0], 1), (h[1], 2), (h[2], 3)])  # DRAM: h1 h2, disk: h0
    assert core.load([(h[0], 4), (h[1], 5), (h[2], 6)]) == LoadResult(3, [])
    assert counters(core) == (2, 1, 0, 3, 0)
    s = core.stats()
    assert (s.dram_blocks, s.disk_blocks) == (2, 1)  # no block went back and forth
    assert all(torch.equal(pool.block_bytes(4 + i), data[i]) for i in range(3))
    assert core.load([(h[0], 4), (h[2], 6)]) == LoadResult(2, [])  # only h2 protected: h1 gives way
    assert core.lookup(h[0:1]) == LookupResult(1, 1)
    assert core.lookup(h[1:2]) == LookupResult(1, 0)


@pytest.mark.parametrize("dram_blocks", [0, 2])
def test_a_long_disk_load_cycles_its_staging_rows(make_core: CoreFactory, make_pool: PoolFactory,
                                                  dram_blocks: int) -> None:
    """40 disk blocks through 16 staging rows (and 2 promotions when DRAM has room)."""
    pool = make_pool(num_blocks=81)
    core = make_core(dram_blocks=dram_blocks, disk_blocks=64)
    core.attach_pool(pool.handle)
    h = chain(40)
    data = fill(pool, list(range(1, 41)))
    core.save([(h[i], i + 1) for i in range(40)])
    for k in range(dram_blocks):  # push the DRAM copies out: everything is on disk only
        core.save([(chain(1, salt=bytes([k + 1]))[0], 80)])
    assert core.lookup(h) == LookupResult(40, 0)
    assert core.load([(h[i], 41 + i) for i in range(40)]) == LoadResult(40, [])
    assert all(torch.equal(pool.block_bytes(41 + i), data[i]) for i in range(40))
    assert core.lookup(h[:2]) == LookupResult(2, dram_blocks)  # the head of the prefix was promoted
    assert core.stats().disk_hits == 40


def test_a_save_larger_than_dram_spills_its_head_to_disk(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    pool = make_pool()
    core = make_core(dram_blocks=2, disk_blocks=8)
    core.attach_pool(pool.handle)
    h = chain(5)
    data = fill(pool, [1, 2, 3, 4, 5])
    assert core.save([(h[i], i + 1) for i in range(5)]) == SaveResult(5, 0)
    s = core.stats()
    assert (s.dram_blocks, s.disk_blocks) == (2, 3)
    assert core.lookup(h) == LookupResult(5, 2)
    pool.raw[:, :, 1:6].zero_()
    assert core.load([(h[i], i + 1) for i in range(5)]) == LoadResult(5, [])
    assert all(torch.equal(pool.block_bytes(i + 1), data[i]) for i in range(5))


def _file(tmp_path: Path, h: BlockHash) -> Path:
    return tmp_path / "data" / "blocks" / h[:1].hex() / f"{h.hex()}.kv"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_bad_file_fails_the_load_without_touching_the_pool(make_core: CoreFactory, make_pool: PoolFactory,
                                                             tmp_path: Path, damage: str, db: DbTarget) -> None:
    pool = make_pool()
    core = make_core(dram_blocks=0)
    core.attach_pool(pool.handle)
    h = chain(3)
    data = fill(pool, [1, 2, 3])
    core.save([(h[0], 1), (h[1], 2), (h[2], 3)])
    path = _file(tmp_path, h[1])
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[500] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        os.truncate(path, BLOCK - 1)
    else:
        path.unlink()
    pool.raw[:, :, 4:7].fill_(0xEE)
    assert core.load([(h[0], 4), (h[1], 5), (h[2], 6)]) == LoadResult(1, [h[1]])
    assert torch.equal(pool.block_bytes(4), data[0])
    assert bool((pool.raw[:, :, 5:7] == 0xEE).all())  # the bad block and the ones after: untouched
    corrupt = 0 if damage == "delete" else 1
    assert counters(core) == (0, 1, 1 - corrupt, 3, corrupt)
    assert core.lookup(h) == LookupResult(1, 0)  # the bad entry is gone, file and row
    assert not path.exists()
    assert core.stats().disk_blocks == 2
    assert core.load([(h[2], 6)]) == LoadResult(1, [])  # the rest of the store still serves


def test_a_corrupt_promotion_releases_its_slot(make_core: CoreFactory, make_pool: PoolFactory,
                                               tmp_path: Path) -> None:
    pool = make_pool()
    core = make_core(dram_blocks=2)
    core.attach_pool(pool.handle)
    h = chain(3)
    fill(pool, [1, 2, 3])
    core.save([(h[0], 1), (h[1], 2), (h[2], 3)])  # h0 on disk only
    _file(tmp_path, h[0]).write_bytes(b"\0" * BLOCK)
    assert core.load([(h[0], 4)]) == LoadResult(0, [h[0]])
    assert core.lookup(h) == LookupResult(0, 0)
    # The slot reserved for the promotion displaced h1 (the LRU) to disk before the read failed:
    # h1 is still held, and the slot is free again rather than holding garbage.
    assert core.lookup(h[1:]) == LookupResult(2, 1)
    assert core.stats().dram_blocks == 1


def test_an_unknown_hash_is_a_miss(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    pool = make_pool()
    core = make_core()
    core.attach_pool(pool.handle)
    h = chain(2)
    fill(pool, [1])
    core.save([(h[0], 1)])
    assert core.load([(h[0], 2), (h[1], 3)]) == LoadResult(1, [h[1]])
    assert counters(core) == (1, 0, 1, 1, 0)


def test_bad_input_raises_and_changes_nothing(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    pool = make_pool()
    core = make_core()
    h = chain(2)
    with pytest.raises(FailedPrecondition, match="no KV pool attached"):
        core.load([(h[0], 1)])
    with pytest.raises(FailedPrecondition, match="no KV pool attached"):
        core.save([(h[0], 1)])
    assert core.lookup(h) == LookupResult(0, 0)  # lookups need no pool
    core.attach_pool(pool.handle)
    with pytest.raises(InvalidArgument, match="must be 32 bytes, got 31"):
        core.lookup([h[0][:31]])
    with pytest.raises(InvalidArgument, match="must be 32 bytes, got 33"):
        core.save([(h[0], 1), (h[1] + b"x", 2)])
    with pytest.raises(InvalidArgument, match=r"outside 1\.\.7"):
        core.save([(h[0], 1), (h[1], 8)])
    with pytest.raises(InvalidArgument, match=r"outside 1\.\.7"):
        core.load([(h[0], 0)])  # the null block is never written
    with pytest.raises(InvalidArgument, match="same pool block twice"):
        core.load([(h[0], 3), (h[1], 3)])
    # The two calls refused before AttachPool are counted (a store without a pool is visible).
    assert core.stats() == OffloadStats(dram_capacity_bytes=4 * BLOCK, disk_capacity_bytes=8 * BLOCK,
                                        pool_attached=True, pool_generation=pool.handle.generation,
                                        refused_no_pool=2)


def test_blocks_of_another_format_are_never_loaded(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    fp16 = make_pool("float16")
    bf16 = make_pool("bfloat16")  # same block size in bytes, other meaning
    core = make_core(block_nbytes=fp16.block_nbytes)
    core.attach_pool(fp16.handle)
    h = chain(1)
    fill(fp16, [1])
    core.save([(h[0], 1)])
    core.attach_pool(bf16.handle)
    assert core.lookup(h) == LookupResult(0, 0)
    assert core.load([(h[0], 2)]) == LoadResult(0, [h[0]])
    assert torch.equal(bf16.block_bytes(2), torch.zeros_like(bf16.block_bytes(2)))
    expected = fill(bf16, [1])[0]
    assert core.save([(h[0], 1)]) == SaveResult(1, 0)  # replaces the fp16 copy
    assert core.load([(h[0], 3)]) == LoadResult(1, [])
    assert torch.equal(bf16.block_bytes(3), expected)


def test_a_new_block_size_moves_dram_to_disk(make_core: CoreFactory, make_pool: PoolFactory) -> None:
    small = make_pool("float32")
    big = make_pool("float32", head_dim=16)  # 2048-byte blocks
    core = make_core(dram_blocks=4, disk_blocks=8)
    core.attach_pool(small.handle)
    h = chain(2)
    fill(small, [1, 2])
    core.save([(h[0], 1), (h[1], 2)])
    assert core.attach_pool(big.handle) == 2 * BLOCK
    s = core.stats()
    assert (s.dram_blocks, s.disk_blocks) == (0, 2)
    assert core.lookup(h) == LookupResult(0, 0)  # those blocks cannot fill this pool
    core.attach_pool(small.handle)
    assert core.lookup(h) == LookupResult(2, 0)


def test_restart_sees_disk_blocks(make_core: CoreFactory, make_pool: PoolFactory, db: DbTarget,
                                  tmp_path: Path) -> None:
    pool = make_pool()
    first = make_core(dram_blocks=1)
    first.attach_pool(pool.handle)
    h = chain(3)
    data = fill(pool, [1, 2, 3])
    first.save([(h[0], 1), (h[1], 2), (h[2], 3)])  # h0, h1 demoted to disk; h2 only in DRAM
    first.close()
    second = make_core(dram_blocks=1)
    assert second.reconcile_report == ReconcileReport(0, 0, 0, 0)
    assert second.lookup(h) == LookupResult(2, 0)  # DRAM does not survive a restart
    second.attach_pool(pool.handle)
    pool.raw.zero_()
    assert second.load([(h[0], 5), (h[1], 6)]) == LoadResult(2, [])
    assert torch.equal(pool.block_bytes(5), data[0]) and torch.equal(pool.block_bytes(6), data[1])
    if db.kind == "sqlite":
        con = sqlite3.connect(tmp_path / "data" / "index.sqlite")
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("SELECT count(*) FROM offload_blocks").fetchone() == (2,)
        con.close()


def test_a_crash_mid_write_recovers_consistently(make_core: CoreFactory, make_pool: PoolFactory,
                                                 tmp_path: Path) -> None:
    """The files a crash leaves: a temp file (cut before its rename) and a complete file whose row
    was never inserted (cut between rename and insert). Neither may be served; both are removed."""
    pool = make_pool()
    first = make_core(dram_blocks=0)
    first.attach_pool(pool.handle)
    h = chain(3)
    data = fill(pool, [1, 2, 3])
    first.save([(h[0], 1)])
    first.close()
    cut_before_rename = _file(tmp_path, h[1]).with_name(f"{h[1].hex()}.kv.0badf00d.tmp")
    cut_before_rename.parent.mkdir(exist_ok=True)
    cut_before_rename.write_bytes(data[1].numpy().tobytes()[:300])
    cut_before_insert = _file(tmp_path, h[2])
    cut_before_insert.parent.mkdir(exist_ok=True)
    cut_before_insert.write_bytes(data[2].numpy().tobytes())
    second = make_core(dram_blocks=0)
    assert second.reconcile_report == ReconcileReport(temp_files_removed=1, orphan_files_removed=1,
                                                      rows_dropped=0, evicted_over_budget=0)
    assert not cut_before_rename.exists() and not cut_before_insert.exists()
    assert second.lookup([h[0]]) == LookupResult(1, 0)
    assert second.lookup(h[1:]) == LookupResult(0, 0)
    second.attach_pool(pool.handle)
    assert second.load([(h[0], 4)]) == LoadResult(1, [])
    assert torch.equal(pool.block_bytes(4), data[0])
    third = make_core(dram_blocks=0)  # a clean start reports nothing to repair
    assert third.reconcile_report == ReconcileReport(0, 0, 0, 0)
    assert dataclasses.asdict(third.stats())["disk_blocks"] == 1
