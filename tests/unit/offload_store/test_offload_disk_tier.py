"""DiskTier + BlockFiles against SQLite and PostgreSQL: atomic writes, verified reads, LRU budget,
and start-up reconciliation of files against rows."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offload_testlib import DbTarget

from services.offload_store.block_files import BlockFault
from services.offload_store.disk_tier import DiskTier, PutResult, ReconcileReport
from services.offload_store.index import BlockIndex
from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash

FMT = BlockFormat("float32", (1, 2, 2, 2, 2), 64)


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def data(i: int) -> torch.Tensor:
    return torch.full((FMT.nbytes,), i, dtype=torch.uint8)


_open: list[DiskTier] = []


@pytest.fixture
def index(db: DbTarget) -> Iterator[BlockIndex]:
    idx = BlockIndex(db.url, db.table)
    yield idx
    while _open:
        _open.pop().close()
    idx.close()


def open_tier(root: Path, index: BlockIndex, blocks: int = 3) -> tuple[DiskTier, ReconcileReport]:
    """A tier over ``root`` with a budget of ``blocks`` blocks, reconciled (closed by the fixture)."""
    tier = DiskTier(root, index, blocks * FMT.nbytes)
    _open.append(tier)
    return tier, tier.reconcile()


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "index.sqlite"
                  and not p.name.startswith("index.sqlite"))


def test_put_writes_content_addressed_files_and_rows(tmp_path: Path, index: BlockIndex) -> None:
    tier, report = open_tier(tmp_path, index)
    assert report == ReconcileReport(0, 0, 0, 0)
    assert tier.put_many([(h(1), FMT, data(1)), (h(2), FMT, data(2))]) == PutResult(2, 0, 0)
    hex1 = h(1).hex()
    assert all_files(tmp_path) == [f"blocks/01/{hex1}.kv", f"blocks/02/{h(2).hex()}.kv"]  # no temp file left
    assert (tmp_path / "blocks" / "01" / f"{hex1}.kv").read_bytes() == bytes([1]) * 64
    row = index.get(h(1))
    assert row is not None
    assert (row.tier, row.size, row.fmt) == ("disk", 64, FMT)
    assert row.checksum == zlib.crc32(bytes([1]) * 64)
    assert tier.used_bytes == 128 and len(tier) == 2
    out = torch.empty(64, dtype=torch.uint8)
    assert tier.read_into(h(2), out) == index.get(h(2))
    assert torch.equal(out, data(2))


def test_a_block_already_stored_is_not_rewritten(tmp_path: Path, index: BlockIndex) -> None:
    tier, _ = open_tier(tmp_path, index)
    tier.put_many([(h(1), FMT, data(1))])
    assert tier.put_many([(h(1), FMT, data(9))]) == PutResult(0, 1, 0)
    assert tier.files.path(h(1)).read_bytes() == bytes([1]) * 64
    other = BlockFormat("bfloat16", (1, 2, 2, 2, 4), 64)  # same size, other meaning: replaced
    assert tier.put_many([(h(1), other, data(9))]) == PutResult(1, 0, 0)
    assert tier.files.path(h(1)).read_bytes() == bytes([9]) * 64
    assert index.get(h(1)).fmt == other  # type: ignore[union-attr]


def test_lru_eviction_deletes_file_and_row(tmp_path: Path, index: BlockIndex) -> None:
    tier, _ = open_tier(tmp_path, index, blocks=3)
    tier.put_many([(h(i), FMT, data(i)) for i in (1, 2, 3)])
    tier.touch([h(1)])  # 2 is now the least recently used
    assert tier.put_many([(h(4), FMT, data(4))]) == PutResult(1, 0, 0)
    assert tier.hashes() == [h(3), h(1), h(4)]
    assert not tier.files.path(h(2)).exists()
    assert index.get(h(2)) is None
    assert [r.block_hash for r in index.all_rows()] == [h(3), h(1), h(4)]
    tier.put_many([(h(5), FMT, data(5)), (h(6), FMT, data(6))])
    assert tier.hashes() == [h(4), h(5), h(6)]
    assert tier.used_bytes == 3 * 64


def test_a_batch_larger_than_the_budget_keeps_its_newest_blocks(tmp_path: Path, index: BlockIndex) -> None:
    tier, _ = open_tier(tmp_path, index, blocks=2)
    assert tier.put_many([(h(i), FMT, data(i)) for i in (1, 2, 3)]) == PutResult(2, 0, 1)
    assert tier.hashes() == [h(2), h(3)]
    empty, _ = open_tier(tmp_path / "zero", index, blocks=0)  # a disabled tier stores nothing
    assert empty.put_many([(h(7), FMT, data(7))]) == PutResult(0, 0, 1)


@pytest.mark.parametrize(("damage", "reason"), [("flip", "checksum"), ("truncate", "truncated"),
                                                ("extend", "truncated"), ("delete", "missing")])
def test_reads_verify_length_and_checksum(tmp_path: Path, index: BlockIndex, damage: str, reason: str) -> None:
    tier, _ = open_tier(tmp_path, index)
    tier.put_many([(h(1), FMT, data(1))])
    path = tier.files.path(h(1))
    if damage == "flip":
        path.write_bytes(bytes([1]) * 63 + b"\x00")
    elif damage == "truncate":
        os.truncate(path, 40)
    elif damage == "extend":
        path.write_bytes(bytes([1]) * 65)
    else:
        path.unlink()
    with pytest.raises(BlockFault) as info:
        tier.read_into(h(1), torch.empty(64, dtype=torch.uint8))
    assert info.value.reason == reason
    tier.remove(h(1))
    assert (len(tier), tier.used_bytes, index.count(), path.exists()) == (0, 0, 0, False)


def test_reconcile_repairs_what_a_crash_or_an_operator_left(tmp_path: Path, index: BlockIndex) -> None:
    tier, _ = open_tier(tmp_path, index, blocks=8)
    tier.put_many([(h(i), FMT, data(i)) for i in (1, 2, 3, 4)])
    blocks = tmp_path / "blocks"
    # a write cut short before its rename
    (blocks / "05" / f"{h(5).hex()}.kv.1a2b3c4d.tmp").parent.mkdir()
    (blocks / "05" / f"{h(5).hex()}.kv.1a2b3c4d.tmp").write_bytes(b"\1" * 10)
    # renamed, but the crash came before its row was inserted: an orphan
    (blocks / "06").mkdir()
    (blocks / "06" / f"{h(6).hex()}.kv").write_bytes(bytes([6]) * 64)
    # an unrelated file: not a block file, left alone
    (blocks / "07").mkdir()
    (blocks / "07" / "README").write_text("not a block")
    os.truncate(tier.files.path(h(2)), 10)  # a row whose file was truncated
    tier.files.path(h(3)).unlink()  # a row whose file is missing
    again, report = open_tier(tmp_path, index, blocks=8)
    assert report == ReconcileReport(temp_files_removed=1, orphan_files_removed=1, rows_dropped=2,
                                     evicted_over_budget=0)
    assert again.hashes() == [h(1), h(4)]
    assert [r.block_hash for r in index.all_rows()] == [h(1), h(4)]
    assert all_files(tmp_path) == [f"blocks/01/{h(1).hex()}.kv", f"blocks/04/{h(4).hex()}.kv",
                                   "blocks/07/README"]
    assert again.used_bytes == 128
    out = torch.empty(64, dtype=torch.uint8)
    again.read_into(h(4), out)
    assert torch.equal(out, data(4))


def test_reopening_keeps_the_lru_order_and_trims_to_a_smaller_budget(tmp_path: Path, index: BlockIndex) -> None:
    tier, _ = open_tier(tmp_path, index, blocks=4)
    for i in (1, 2, 3, 4):
        tier.put_many([(h(i), FMT, data(i))])
    tier.touch([h(1)])  # order: 2 3 4 1
    again, report = open_tier(tmp_path, index, blocks=2)
    assert report == ReconcileReport(0, 0, 0, evicted_over_budget=2)
    assert again.hashes() == [h(4), h(1)]
    assert all_files(tmp_path) == [f"blocks/01/{h(1).hex()}.kv", f"blocks/04/{h(4).hex()}.kv"]
