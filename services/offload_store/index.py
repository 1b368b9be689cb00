"""The metadata index of the disk tier: one row per complete block file, in any SQLAlchemy database.

SQLite (the default, ``<data_dir>/index.sqlite``) runs with ``journal_mode=WAL`` and
``synchronous=NORMAL``: commits do not wait for an fsync, and a power cut may lose the last
commits but never corrupts the database. That is safe here because the rows only ever lag the
files in one direction that start-up reconciliation repairs (see ``DiskTier.reconcile``):
a row is inserted after its file is renamed into place and deleted before its file is unlinked.
PostgreSQL (``postgresql+psycopg://...``) works unchanged, e.g. for an index shared by tools.

This module holds rows only; it never touches block files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Float,
    LargeBinary,
    MetaData,
    String,
    Table,
    create_engine,
    delete,
    event,
    func,
    select,
    update,
)

from services.offload_store.types import BlockFormat
from shared.hashing import HASH_BYTES, BlockHash

TIER_DISK = "disk"
_CHUNK = 500  # hashes per IN (...) clause: far below every backend's bound-parameter limit


@dataclass(frozen=True)
class IndexRow:
    """One stored block file.

    Attributes:
        block_hash: the key (32 bytes).
        tier: the durable tier holding the bytes; ``"disk"`` today.
        size: file length in bytes (== ``fmt.nbytes``).
        checksum: CRC-32 of the file's bytes.
        fmt: dtype and block shape of the bytes.
        created_at: when the file was written (Unix seconds).
        last_access: when it was last written or read (Unix seconds); disk LRU order.
    """

    block_hash: BlockHash
    tier: str
    size: int
    checksum: int
    fmt: BlockFormat
    created_at: float
    last_access: float


def _table(metadata: MetaData, name: str) -> Table:
    return Table(
        name,
        metadata,
        Column("block_hash", LargeBinary(HASH_BYTES), primary_key=True),
        Column("tier", String(16), nullable=False),
        Column("size", BigInteger, nullable=False),
        Column("checksum", BigInteger, nullable=False),  # CRC-32 is unsigned: needs 64 bits
        Column("dtype", String(32), nullable=False),
        Column("shape", String(64), nullable=False),  # "30,2,16,3,64"
        Column("created_at", Float, nullable=False),
        Column("last_access", Float, nullable=False, index=True),
    )


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _chunks(items: Sequence[BlockHash]) -> Iterable[Sequence[BlockHash]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


class BlockIndex:
    """Rows of block files, keyed by hash.

    Args:
        url: any SQLAlchemy URL.
        table_name: the table to use (created if missing).
    """

    def __init__(self, url: str, table_name: str = "offload_blocks") -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        connect_args: dict[str, Any] = {}
        if self.is_sqlite:
            # The servicer serialises calls with a lock, but they arrive on grpc pool threads.
            connect_args["check_same_thread"] = False
        self._engine: Engine = create_engine(url, connect_args=connect_args, pool_pre_ping=not self.is_sqlite)
        if self.is_sqlite:
            event.listen(self._engine, "connect", _sqlite_pragmas)
        self._table = _table(MetaData(), table_name)
        self._table.create(self._engine, checkfirst=True)

    def close(self) -> None:
        """Closes every pooled connection."""
        self._engine.dispose()

    def insert_many(self, rows: Sequence[IndexRow]) -> None:
        """Adds rows (replacing any under the same hash) in one transaction."""
        if not rows:
            return
        t = self._table
        with self._engine.begin() as conn:
            self._delete(conn, [r.block_hash for r in rows])
            conn.execute(t.insert(), [
                {"block_hash": r.block_hash, "tier": r.tier, "size": r.size, "checksum": r.checksum,
                 "dtype": r.fmt.dtype, "shape": r.fmt.shape_text(), "created_at": r.created_at,
                 "last_access": r.last_access}
                for r in rows
            ])

    def delete_many(self, hashes: Sequence[BlockHash]) -> None:
        """Removes the rows of ``hashes`` (absent ones are ignored) in one transaction."""
        if hashes:
            with self._engine.begin() as conn:
                self._delete(conn, hashes)

    def touch_many(self, hashes: Sequence[BlockHash], when: float) -> None:
        """Sets ``last_access`` of ``hashes`` to ``when``."""
        if not hashes:
            return
        t = self._table
        with self._engine.begin() as conn:
            for part in _chunks(hashes):
                conn.execute(update(t).where(t.c.block_hash.in_(part)).values(last_access=when))

    def get(self, block_hash: BlockHash) -> IndexRow | None:
        """The row of ``block_hash``, if any."""
        t = self._table
        with self._engine.connect() as conn:
            row = conn.execute(select(t).where(t.c.block_hash == block_hash)).first()
        return None if row is None else self._from_db(row._mapping)

    def all_rows(self) -> list[IndexRow]:
        """Every row, least recently accessed first (the disk tier's LRU order)."""
        t = self._table
        with self._engine.connect() as conn:
            result = conn.execute(select(t).order_by(t.c.last_access, t.c.created_at, t.c.block_hash))
            return [self._from_db(r._mapping) for r in result]

    def count(self) -> int:
        """Number of rows."""
        with self._engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self._table)).scalar_one())

    def _delete(self, conn: Connection, hashes: Sequence[BlockHash]) -> None:
        t = self._table
        for part in _chunks(hashes):
            conn.execute(delete(t).where(t.c.block_hash.in_(part)))

    @staticmethod
    def _from_db(m: Any) -> IndexRow:
        shape = BlockFormat.parse_shape(m["shape"])
        return IndexRow(
            block_hash=BlockHash(bytes(m["block_hash"])),
            tier=m["tier"],
            size=int(m["size"]),
            checksum=int(m["checksum"]),
            fmt=BlockFormat(m["dtype"], shape, int(m["size"])),
            created_at=float(m["created_at"]),
            last_access=float(m["last_access"]),
        )
