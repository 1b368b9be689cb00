"""The offload-store as a real process over gRPC: a pool file made here, AttachPool, Save, Lookup,
Load with the bytes checked in the pool, status codes for bad input, health, SIGTERM, restart."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.offload_store.client import RemoteOffload
from shared.hashing import hash_blocks, hash_seed
from shared.launcher import ServiceProcess
from shared.owner_channel import with_owner
from shared.pb.kvmesh.v1 import common_pb2, offload_store_pb2, offload_store_pb2_grpc
from shared.tensor_handle import KIND_SHM_FILE, SharedTensorHandle

# [layers, 2, num_blocks, block_size, kv_heads, head_dim] fp16: 32 KiB per block
SHAPE = (4, 2, 8, 16, 2, 64)
BLOCK_BYTES = 4 * 2 * 16 * 2 * 64 * 2
NBYTES = math.prod(SHAPE) * 2


@pytest.fixture
def pool_file() -> Iterator[tuple[str, torch.Tensor]]:
    path = f"/dev/shm/kvmesh-offload-itest-{uuid.uuid4().hex}.kv"
    with open(path, "wb") as f:
        f.truncate(NBYTES)
    raw = torch.from_file(path, shared=True, size=NBYTES, dtype=torch.uint8).view(*SHAPE[:5], SHAPE[5] * 2)
    yield path, raw
    os.unlink(path)


def start(data_dir: Path) -> ServiceProcess:
    return ServiceProcess("offload-store", env={
        "KVMESH_OFFLOAD_DATA_DIR": str(data_dir),
        "KVMESH_OFFLOAD_DRAM_BYTES": str(2 * BLOCK_BYTES),
        "KVMESH_OFFLOAD_DISK_BYTES": str(16 * BLOCK_BYTES),
    })


def refs(hashes: list[bytes], ids: list[int]) -> list[offload_store_pb2.BlockRef]:
    return [offload_store_pb2.BlockRef(block_hash=h, block_id=b) for h, b in zip(hashes, ids, strict=True)]


def test_offload_store_service(tmp_path: Path, pool_file: tuple[str, torch.Tensor]) -> None:
    path, raw = pool_file
    handle = common_pb2.SharedTensorHandle(kind=common_pb2.SharedTensorHandle.KIND_SHM_FILE, path=path,
                                           dtype="float16", shape=SHAPE, nbytes=NBYTES, generation="g1")
    hashes = hash_blocks(hash_seed(b"itest", "tiny"), list(range(48)), 16)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, raw[:, :, 1:4].shape, dtype=torch.uint8, generator=gen)
    raw[:, :, 1:4] = data
    svc = start(tmp_path / "data")
    try:
        with grpc.insecure_channel(svc.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvmesh.v1.OffloadStore"), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = offload_store_pb2_grpc.OffloadStoreStub(with_owner(channel, "itest"))

            with pytest.raises(grpc.RpcError) as err:
                stub.Load(offload_store_pb2.LoadRequest(blocks=refs(hashes[:1], [4])), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "AttachPool" in (err.value.details() or "")
            bad = common_pb2.SharedTensorHandle()
            bad.CopyFrom(handle)
            bad.dtype = "float17"
            with pytest.raises(grpc.RpcError) as err:
                stub.AttachPool(offload_store_pb2.AttachPoolRequest(pool=bad), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown dtype 'float17'" in (err.value.details() or "")
            bad.dtype, bad.path = "float16", path + ".gone"  # the runner's pool closed or re-created
            with pytest.raises(grpc.RpcError) as err:
                stub.AttachPool(offload_store_pb2.AttachPoolRequest(pool=bad), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND  # as the runner's own kv_pool.attach says
            assert f"shared tensor file '{path}.gone' does not exist" in (err.value.details() or "")

            attached = stub.AttachPool(offload_store_pb2.AttachPoolRequest(pool=handle), timeout=5)
            assert attached.bytes_per_block == BLOCK_BYTES
            save = offload_store_pb2.SaveRequest(blocks=refs(hashes, [1, 2, 3]))
            assert save.ByteSize() < 200  # hashes and ids only: the 96 KiB of KV go through /dev/shm
            assert stub.Save(save, timeout=5) == offload_store_pb2.SaveResponse(num_saved=3, num_skipped=0)
            assert stub.Lookup(_lookup(hashes, hashes[:1]), timeout=5) == \
                offload_store_pb2.LookupResponse(num_present=[3, 1], num_in_dram=[2, 0])

            raw[:, :, 4:7].zero_()
            load = stub.Load(offload_store_pb2.LoadRequest(blocks=refs(hashes, [4, 5, 6])), timeout=5)
            assert load.num_loaded == 3 and list(load.failed_hashes) == []
            assert torch.equal(raw[:, :, 4:7], data)

            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(_lookup([b"\x01" * 31]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "32 bytes" in (err.value.details() or "")
            unknown = b"\x07" * 32
            miss = stub.Load(offload_store_pb2.LoadRequest(blocks=refs([unknown], [7])), timeout=5)
            assert miss.num_loaded == 0 and list(miss.failed_hashes) == [unknown]

            stats = stub.GetStats(offload_store_pb2.GetOffloadStatsRequest(), timeout=5)
            assert (stats.dram_blocks, stats.disk_blocks, stats.saves) == (2, 1, 3)
            assert (stats.dram_hits, stats.disk_hits, stats.misses, stats.corruptions) == (2, 1, 1, 0)
            assert (stats.dram_capacity_bytes, stats.disk_capacity_bytes) == (2 * BLOCK_BYTES, 16 * BLOCK_BYTES)
    finally:
        assert svc.stop() == 0, svc.log_tail()

    # A new process over the same data dir: the disk block (h0, demoted by h2's save) is there.
    again = start(tmp_path / "data")
    try:
        with grpc.insecure_channel(again.address) as channel:
            stub = offload_store_pb2_grpc.OffloadStoreStub(with_owner(channel, "itest-2"))
            stub.AttachPool(offload_store_pb2.AttachPoolRequest(pool=handle), timeout=5)  # a new owner
            assert stub.Lookup(_lookup(hashes), timeout=5) == \
                offload_store_pb2.LookupResponse(num_present=[1], num_in_dram=[0])
            raw[:, :, 7].zero_()
            load = stub.Load(offload_store_pb2.LoadRequest(blocks=refs(hashes[:2], [7, 6])), timeout=5)
            assert load.num_loaded == 1 and list(load.failed_hashes) == [hashes[1]]
            assert torch.equal(raw[:, :, 7], data[:, :, 0])
    finally:
        assert again.stop() == 0, again.log_tail()


def _lookup(*chains: list[bytes]) -> offload_store_pb2.LookupRequest:
    return offload_store_pb2.LookupRequest(chains=[offload_store_pb2.HashChain(block_hashes=c) for c in chains])


def test_remote_offload_client_reattaches_a_restarted_store(tmp_path: Path,
                                                           pool_file: tuple[str, torch.Tensor]) -> None:
    """The scheduler's client (services/offload_store/client.py) against a real store: its verbs,
    then a store restart on the same port: the next owner call is refused (no pool, no owner),
    the client re-attaches the pool it attached last and the call succeeds."""
    path, raw = pool_file
    handle = SharedTensorHandle(kind=KIND_SHM_FILE, dtype="float16", shape=SHAPE, nbytes=NBYTES, path=path)
    hashes = hash_blocks(hash_seed(b"itest", "tiny"), list(range(48)), 16)
    raw[:, :, 1:4] = torch.randint(0, 256, raw[:, :, 1:4].shape, dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(1))
    first = start(tmp_path / "data")
    client = RemoteOffload(first.address, timeout=5, owner_id="sched-1", lease_seconds=5)
    try:
        client.attach(handle)
        assert client.save([(hashes[0], 1), (hashes[1], 2)]) == 2
        assert client.lookup([hashes, hashes[1:], hashes[2:]]) == [2, 1, 0]
        assert client.load([(hashes[0], 5), (hashes[2], 6)]) == 1
        assert torch.equal(raw[:, :, 5], raw[:, :, 1])
        client.keepalive()
        stats = client.stats()
        assert (stats.saves, stats.dram_hits, stats.misses, stats.pool_attached) == (2, 1, 1, True)
        port = first.port
        assert first.stop() == 0, first.log_tail()

        second = ServiceProcess("offload-store", port=port, env={
            "KVMESH_OFFLOAD_DATA_DIR": str(tmp_path / "data-2"),
            "KVMESH_OFFLOAD_DRAM_BYTES": str(2 * BLOCK_BYTES),
            "KVMESH_OFFLOAD_DISK_BYTES": str(16 * BLOCK_BYTES),
        })
        try:
            assert client.stats().pool_attached is False  # a fresh store: nothing mapped, no owner
            assert client.save([(hashes[2], 3)]) == 1  # refused, re-attached, retried once
            after = client.stats()
            assert (after.pool_attached, after.saves) == (True, 1)
            client.release()
            assert client.stats().pool_attached is False
        finally:
            assert second.stop() == 0, second.log_tail()
    finally:
        client.close()
