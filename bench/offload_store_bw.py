"""Bandwidth of the offload-store's save and load paths, DRAM tier and disk tier, in one run.

Geometry: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), block size 16, fp32 KV:
30 * 2 * 16 * 3 * 64 * 4 = 737,280 bytes per block; ``--blocks`` blocks (128 = a 2048-token
prefix, 94.4 MB) per call. The pool is a real ``/dev/shm`` file mapped twice (once as the runner
would, once by the store), exactly as in production; the store runs in-process (gRPC adds about
one millisecond per call, see MACHINE-FACTS.md).

Rows:
  torch copy          peer: ``dst.copy_(src)`` of the same number of contiguous bytes
  crc32               peer: ``zlib.crc32`` over those bytes (the disk path checksums every block)
  dram save / load    ``save`` into / ``load`` from the DRAM tier (disk tier not touched)
  disk save           ``save`` with DRAM disabled: copy out, CRC-32, write + fsync each file,
                      rename, fsync folders, one index transaction (SQLite, WAL)
  disk load (cached)  ``load`` with DRAM disabled, files in the page cache: read, verify, copy in
  disk load (cold)    the same after ``posix_fadvise(DONTNEED)`` on every file (our files only,
                      no global cache drop), so reads go to the device (or the VM host's cache)
  redis set / get     peer: one redis-py pipeline of ``--blocks`` plain SETs / GETs of block-sized
                      values (the client and server cost alone, no header, no checksum)
  remote save         ``save`` by a store whose only tier is Redis (``--redis-url``; DRAM and disk
                      budgets 0): copy out, header + CRC-32, an EXISTS pipeline, a SET pipeline
                      per 16 blocks (the staging rows); the keys are deleted before each call
  remote load         ``load`` by another store (another replica) of the same blocks: GET
                      pipelines of up to 64 MiB, verify, copy into its pool

Each row is the median of ``--repeat`` timed calls after one warm-up; GB/s = bytes / time. Torch
runs with ``--threads`` intra-op threads (default 1, the service's default; 0 = torch's default),
peers included.
Run: ``python bench/offload_store_bw.py [--data-dir /var/tmp] [--redis-url URL | --redis-url ""]``; writes
``bench/results/offload_store_bw.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.offload_store.config import OffloadConfig  # noqa: E402
from services.offload_store.pool_mapping import PoolHandle  # noqa: E402
from services.offload_store.store import OffloadStore  # noqa: E402
from shared.tensor_handle import KIND_SHM_FILE  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, ITEMSIZE = 30, 3, 64, 16, 4
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * ITEMSIZE  # 737,280


def median_seconds(fn: Callable[[int], Any], repeat: int, before: Callable[[int], Any] | None = None) -> float:
    """Median wall time of ``fn(i)`` over ``repeat`` calls after one warm-up (i = 0).

    ``before(i)`` runs untimed before each call.
    """
    times = []
    for i in range(repeat + 1):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        fn(i)
        dt = time.perf_counter() - t0
        if i > 0:
            times.append(dt)
    return statistics.median(times)


def make_pool(num_blocks: int) -> tuple[PoolHandle, torch.Tensor]:
    shape = (LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    nbytes = num_blocks * BLOCK_BYTES
    path = f"/dev/shm/kvmesh-offload-bench-{uuid.uuid4().hex}.kv"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    pool = torch.from_file(path, shared=True, size=nbytes // ITEMSIZE, dtype=torch.float32).view(shape)
    pool.normal_()
    handle = PoolHandle(kind=KIND_SHM_FILE, dtype="float32", shape=shape, nbytes=nbytes, path=path)
    return handle, pool


def hashes_for(rep: int, n: int) -> list[bytes]:
    return [rep.to_bytes(4, "big") + i.to_bytes(4, "big") + b"\0" * 24 for i in range(n)]


def fadvise_dontneed(data_dir: Path) -> None:
    for path in (data_dir / "blocks").rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def peers(nbytes: int, repeat: int) -> dict[str, float]:
    """Seconds for the plain memory copy and the CRC-32 of ``nbytes`` contiguous bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    view = src.numpy().data
    return {
        "torch copy": median_seconds(lambda _: dst.copy_(src), repeat),
        "crc32": median_seconds(lambda _: zlib.crc32(view), repeat),
    }


def remote_rows(handle: PoolHandle, pool: torch.Tensor, blocks: int, repeat: int, work: Path, url: str
                ) -> dict[str, float]:
    """The remote-tier rows (see the module docstring); keys under a prefix of their own, deleted."""
    import redis

    prefix = f"kvmesh-bench:{uuid.uuid4().hex[:8]}:"
    raw = redis.Redis.from_url(url)
    rows: dict[str, float] = {}
    src_ids, dst_ids = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    values = [torch.empty(BLOCK_BYTES, dtype=torch.uint8).random_(0, 255).numpy().tobytes() for _ in range(blocks)]
    keys = [f"{prefix}raw:{i}" for i in range(blocks)]

    def pipe(fill: Callable[[Any], Any]) -> Any:
        p = raw.pipeline(transaction=False)
        fill(p)
        return p.execute()

    def clear(_: int) -> None:
        found = list(raw.scan_iter(match=prefix + "*", count=1000))
        if found:
            raw.delete(*found)

    stores: list[OffloadStore] = []
    try:
        rows["redis set"] = median_seconds(lambda _: pipe(lambda p: [p.set(k, v) for k, v in zip(keys, values,
                                                                                            strict=True)]), repeat)
        rows["redis get"] = median_seconds(lambda _: pipe(lambda p: [p.get(k) for k in keys]), repeat)
        clear(0)
        for name in ("a", "b"):
            cfg = OffloadConfig(data_dir=str(work / f"remote-{name}"), dram_bytes=0, disk_bytes=0,
                                remote_url=url, remote_key_prefix=prefix, remote_timeout_seconds=5.0)
            stores.append(OffloadStore(cfg))
            stores[-1].attach_pool(handle)
        a, b = stores
        hashes = hashes_for(0, blocks)
        rows["remote save"] = median_seconds(lambda _: a.save(list(zip(hashes, src_ids, strict=True))), repeat,
                                             before=clear)
        pool[:, :, dst_ids] = 0
        rows["remote load"] = median_seconds(lambda _: b.load(list(zip(hashes, dst_ids, strict=True))), repeat)
        assert torch.equal(pool[:, :, dst_ids], pool[:, :, src_ids]), "remote load: wrong bytes"
        assert b.remote is not None and b.remote.stats.hits == (repeat + 1) * blocks and b.remote.stats.errors == 0
        return rows
    finally:
        clear(0)
        for store in stores:
            store.close()
        raw.close()


def run(blocks: int, repeat: int, data_root: str, redis_url: str = "") -> dict[str, Any]:
    nbytes = blocks * BLOCK_BYTES
    handle, pool = make_pool(2 * blocks + 1)  # sources 1..blocks, destinations blocks+1..2*blocks
    src_ids = list(range(1, blocks + 1))
    dst_ids = list(range(blocks + 1, 2 * blocks + 1))
    work = Path(tempfile.mkdtemp(prefix="kvmesh-offload-bench-", dir=data_root))
    rows: dict[str, float] = {}
    try:
        rows.update(peers(nbytes, repeat))
        # DRAM: room for one call's blocks; the disk tier is disabled, so each save evicts the
        # previous call's blocks without I/O and reuses the same (warm) slots.
        dram = OffloadStore(OffloadConfig(data_dir=str(work / "dram"), dram_bytes=nbytes, disk_bytes=0))
        dram.attach_pool(handle)
        rows["dram save"] = median_seconds(
            lambda i: dram.save(list(zip(hashes_for(i, blocks), src_ids, strict=True))), repeat
        )
        last = hashes_for(repeat, blocks)
        rows["dram load"] = median_seconds(lambda _: dram.load(list(zip(last, dst_ids, strict=True))), repeat)
        assert torch.equal(pool[:, :, dst_ids[-1]], pool[:, :, src_ids[-1]]), "dram load: wrong bytes"
        assert dram.stats().dram_hits == (repeat + 1) * blocks
        dram.close()

        disk_dir = work / "disk"
        disk = OffloadStore(OffloadConfig(data_dir=str(disk_dir), dram_bytes=0, disk_bytes=(repeat + 2) * nbytes))
        disk.attach_pool(handle)
        rows["disk save"] = median_seconds(
            lambda i: disk.save(list(zip(hashes_for(i, blocks), src_ids, strict=True))), repeat
        )
        last = hashes_for(repeat, blocks)
        rows["disk load (cached)"] = median_seconds(lambda _: disk.load(list(zip(last, dst_ids, strict=True))), repeat)
        rows["disk load (cold)"] = median_seconds(
            lambda _: disk.load(list(zip(last, dst_ids, strict=True))),
            repeat,
            before=lambda _: fadvise_dontneed(disk_dir),
        )
        assert torch.equal(pool[:, :, dst_ids[0]], pool[:, :, src_ids[0]]), "disk load: wrong bytes"
        stats = disk.stats()
        assert stats.disk_hits == 2 * (repeat + 1) * blocks and stats.corruptions == 0
        disk.close()
        if redis_url:
            rows.update(remote_rows(handle, pool, blocks, repeat, work, redis_url))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.unlink(handle.path)

    peer = nbytes / rows["torch copy"]
    results = [
        {
            "op": op,
            "seconds": sec,
            "ms_per_block": 1e3 * sec / blocks,
            "gb_per_s": nbytes / sec / 1e9,
            "vs_torch_copy": (nbytes / sec) / peer,
        }
        for op, sec in rows.items()
    ]
    return {
        "geometry": {
            "model": "SmolLM2-135M",
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
            "bytes_per_block": BLOCK_BYTES,
            "blocks_per_call": blocks,
            "bytes_per_call": nbytes,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "data_dir": data_root,
        },
        "repeat": repeat,
        "results": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--data-dir", default="/var/tmp", help="where the disk tier's files go (a real disk)")
    parser.add_argument(
        "--threads", type=int, default=OffloadConfig.torch_threads, help="torch intra-op threads (0 = torch's default)"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="the remote tier's Redis (empty: skip the remote rows)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "offload_store_bw.json"))
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report = run(args.blocks, args.repeat, args.data_dir, args.redis_url)
    geo = report["geometry"]
    print(
        f"offload-store bandwidth: {geo['blocks_per_call']} blocks x {geo['bytes_per_block']:,} B "
        f"= {geo['bytes_per_call'] / 1e6:.1f} MB per call, median of {report['repeat']}"
    )
    print(f"{'op':<20} {'GB/s':>8} {'ms/call':>9} {'ms/block':>9} {'vs copy':>8}")
    for r in report["results"]:
        print(
            f"{r['op']:<20} {r['gb_per_s']:>8.2f} {1e3 * r['seconds']:>9.2f} {r['ms_per_block']:>9.3f} "
            f"{r['vs_torch_copy']:>8.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
