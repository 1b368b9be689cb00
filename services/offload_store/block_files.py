"""Content-addressed block files: layout, crash-safe writes, verified reads (no index, no budget).

Layout::

    <root>/blocks/<hh>/<hash hex>.kv        hh = the hash's first byte in hex (256 folders)
    <root>/blocks/<hh>/<hash hex>.kv.<rand>.tmp   a write in progress (or one a crash cut short)

A file holds exactly one block's bytes (``[layers, 2, block_size, kv_heads, head_dim]`` in the
pool's dtype, C order) and nothing else; its length and CRC-32 live in the index.

Crash safety: bytes go to a temp file in the destination folder, which is fsynced, renamed over
the final name (atomic on POSIX) and the folder is fsynced, so after a crash a ``.kv`` file is
either absent or complete; leftover ``.tmp`` files are garbage for reconciliation to remove.

A batch's temp files are written, checksummed and fsynced by a few I/O threads at once (the
syscalls and ``zlib.crc32`` release the GIL): measured on this machine's virtual disk, 737 KB
files took ~6.5 ms each written and fsynced one by one, ~2-3 ms each with 8 in flight.

Checksum: CRC-32 (``zlib.crc32`` over a memoryview, no copy, GIL released). It guards against
torn or rotted files, not against an adversary; measured here at ~3 GB/s versus ~0.8 GB/s for
blake2b and ~1.7 GB/s for sha256, and it only runs on the disk path, whose bandwidth is lower.
"""

from __future__ import annotations

import os
import secrets
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from shared.hashing import HASH_BYTES, BlockHash

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


class BlockFault(Exception):
    """A block file that cannot be served: ``reason`` is "missing", "truncated" or "checksum"."""

    def __init__(self, block_hash: BlockHash, reason: str) -> None:
        super().__init__(f"block {block_hash.hex()[:16]}: {reason}")
        self.block_hash = block_hash
        self.reason = reason


def checksum(data: memoryview) -> int:
    """CRC-32 of ``data`` (unsigned)."""
    return zlib.crc32(data) & 0xFFFFFFFF


class BlockFiles:
    """The block files under ``<root>/blocks``.

    Args:
        root: the data dir.
        io_threads: temp files written and fsynced at once by :meth:`write_many`.
    """

    def __init__(self, root: str | os.PathLike[str], io_threads: int = 4) -> None:
        self.dir = Path(root) / "blocks"
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.dir.parent)
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None  # started on the first write

    def close(self) -> None:
        """Stops the I/O threads (a later write starts them again)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def path(self, block_hash: BlockHash) -> Path:
        """Where the file of ``block_hash`` lives."""
        return self.dir / block_hash[:1].hex() / (block_hash.hex() + SUFFIX)

    def write_many(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int]:
        """Writes each block's file atomically (temp, fsync, rename), then fsyncs the folders.

        Renames happen only after every temp file is durable, and each folder is fsynced once,
        so a batch costs one fsync per file plus one per folder touched.

        Returns:
            The CRC-32 of each block, computed while writing.
        """
        staged: list[tuple[Path, Path]] = []
        try:
            for block_hash, _ in items:
                final = self.path(block_hash)
                folder = final.parent
                if not folder.is_dir():
                    folder.mkdir(exist_ok=True)
                    _fsync_dir(self.dir)
                staged.append((folder / f"{final.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}", final))
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="offload-io")
            jobs = [self._executor.submit(_write_file, t, d) for (t, _), (_, d) in zip(staged, items, strict=True)]
            wait(jobs)  # all of them, even after a failure: no write may outlive the cleanup below
            crcs = [job.result() for job in jobs]
            for tmp, final in staged:
                os.replace(tmp, final)
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            raise
        for folder in {final.parent for _, final in staged}:
            _fsync_dir(folder)
        return crcs

    def read_into(self, block_hash: BlockHash, out: memoryview, expected_checksum: int) -> None:
        """Fills ``out`` with the file's bytes after checking its length, then its checksum.

        Raises:
            BlockFault: the file is missing, has another length, or fails its checksum. ``out``
                then holds garbage and must not be used.
        """
        try:
            fd = os.open(self.path(block_hash), os.O_RDONLY)
        except FileNotFoundError:
            raise BlockFault(block_hash, "missing") from None
        try:
            if os.fstat(fd).st_size != len(out):
                raise BlockFault(block_hash, "truncated")
            pos = 0
            while pos < len(out):
                n = os.readv(fd, [out[pos:]])
                if n == 0:  # shrank under us
                    raise BlockFault(block_hash, "truncated")
                pos += n
        finally:
            os.close(fd)
        if checksum(out) != expected_checksum:
            raise BlockFault(block_hash, "checksum")

    def remove(self, block_hash: BlockHash) -> None:
        """Deletes the file of ``block_hash`` if it exists."""
        self.path(block_hash).unlink(missing_ok=True)

    def scan(self) -> Iterator[tuple[Path, BlockHash | None, int]]:
        """Every file under the blocks folder: (path, its hash or None if not a block file, size).

        A ``.kv`` file counts as a block only under its own ``<hh>`` folder.
        """
        for folder in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            for path in sorted(folder.iterdir()):
                yield path, _hash_of(path), path.stat().st_size


def _hash_of(path: Path) -> BlockHash | None:
    name = path.name
    if not name.endswith(SUFFIX):
        return None
    try:
        raw = bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None
    if len(raw) != HASH_BYTES or raw[:1].hex() != path.parent.name:
        return None
    return BlockHash(raw)


def _write_file(path: Path, data: memoryview) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pos = 0
        while pos < len(data):
            pos += os.write(fd, data[pos:])
        crc = checksum(data)  # overlaps with the write-back that the fsync below waits for
        os.fsync(fd)
    finally:
        os.close(fd)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
