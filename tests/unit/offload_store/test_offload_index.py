"""BlockIndex against SQLite and PostgreSQL: rows, LRU order, replacement, SQLite pragmas."""

from __future__ import annotations

import sqlite3

from offload_testlib import DbTarget

from services.offload_store.index import BlockIndex, IndexRow
from services.offload_store.types import BlockFormat
from shared.hashing import BlockHash

FMT = BlockFormat("float16", (30, 2, 16, 3, 64), 368_640)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(2, "big") * 16)


def row(i: int, last_access: float, checksum: int = 7) -> IndexRow:
    return IndexRow(h(i), "disk", FMT.nbytes, checksum, FMT, created_at=100.0 + i, last_access=last_access)


def test_rows_round_trip_in_lru_order(db: DbTarget) -> None:
    index = BlockIndex(db.url, db.table)
    try:
        rows = [row(1, 30.0), row(2, 10.0, checksum=0xFFFFFFFF), row(3, 20.0)]
        index.insert_many(rows)
        assert index.count() == 3
        assert index.all_rows() == [rows[1], rows[2], rows[0]]  # oldest access first
        assert index.get(h(2)) == rows[1]  # an unsigned 32-bit checksum survives
        assert index.get(h(9)) is None
        index.touch_many([h(2)], 40.0)
        assert [r.block_hash for r in index.all_rows()] == [h(3), h(1), h(2)]
        index.delete_many([h(1), h(9)])
        assert [r.block_hash for r in index.all_rows()] == [h(3), h(2)]
    finally:
        index.close()


def test_insert_replaces_a_row_under_the_same_hash(db: DbTarget) -> None:
    index = BlockIndex(db.url, db.table)
    try:
        index.insert_many([row(1, 1.0, checksum=1)])
        index.insert_many([row(1, 2.0, checksum=2)])
        assert index.all_rows() == [row(1, 2.0, checksum=2)]
    finally:
        index.close()


def test_rows_survive_reopening(db: DbTarget) -> None:
    index = BlockIndex(db.url, db.table)
    index.insert_many([row(i, float(i)) for i in range(1, 601)])  # more than one IN (...) chunk
    index.close()
    again = BlockIndex(db.url, db.table)
    try:
        assert again.count() == 600
        again.delete_many([h(i) for i in range(1, 600)])
        assert again.all_rows() == [row(600, 600.0)]
    finally:
        again.close()


def test_sqlite_runs_in_wal_mode_with_normal_sync(tmp_path: object) -> None:
    path = f"{tmp_path}/index.sqlite"
    index = BlockIndex(f"sqlite:///{path}")
    try:
        index.insert_many([row(1, 1.0)])
        with index._engine.connect() as conn:  # the pragmas are per connection: ask one of ours
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        con = sqlite3.connect(path)
        assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)  # persistent, in the file
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        con.close()
    finally:
        index.close()
