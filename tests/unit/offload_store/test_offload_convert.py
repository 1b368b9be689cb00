"""convert.py: every message of offload_store.proto, both directions, field for field."""

from __future__ import annotations

import dataclasses

from services.offload_store import convert
from services.offload_store.types import LoadResult, LookupResult, OffloadStats, SaveResult
from shared.pb.kvmesh.v1 import offload_store_pb2 as pb
from shared.tensor_handle import SharedTensorHandle, handle_to_proto

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
HANDLE = SharedTensorHandle(kind="shm_file", dtype="float16", shape=(2, 2, 8, 4, 2, 8), nbytes=8192,
                            generation="g7", path="/dev/shm/kvmesh-kv-g7.kvpool")


def test_attach_both_directions_and_both_handle_forms() -> None:
    msg = convert.attach_to_pb(HANDLE, 2.5)
    assert msg == pb.AttachPoolRequest(pool=handle_to_proto(HANDLE), lease_seconds=2.5)
    assert convert.attach_to_pb(handle_to_proto(HANDLE), 2.5) == msg  # the runner's proto, forwarded
    assert convert.attach_from_pb(msg) == (HANDLE, 2.5)
    assert convert.attached_to_pb(4096) == pb.AttachPoolResponse(bytes_per_block=4096)
    assert convert.attached_from_pb(pb.AttachPoolResponse(bytes_per_block=4096)) == 4096


def test_lookup_both_directions() -> None:
    msg = convert.lookup_to_pb([[H1, H2], [], [H3]])
    assert [list(c.block_hashes) for c in msg.chains] == [[H1, H2], [], [H3]]
    assert convert.lookup_from_pb(msg) == [[H1, H2], [], [H3]]
    answer = convert.lookup_results_to_pb([LookupResult(2, 1), LookupResult(0, 0), LookupResult(1, 0)])
    assert answer == pb.LookupResponse(num_present=[2, 0, 1], num_in_dram=[1, 0, 0])
    assert convert.lookup_results_from_pb(answer) == [LookupResult(2, 1), LookupResult(0, 0), LookupResult(1, 0)]


def test_save_and_load_both_directions() -> None:
    blocks = [(H1, 3), (H2, 9)]
    save = convert.save_to_pb(blocks)
    assert [(r.block_hash, r.block_id) for r in save.blocks] == blocks
    assert convert.save_from_pb(save) == blocks
    assert convert.save_from_pb(convert.save_to_pb([])) == []  # the keepalive's empty Save
    assert convert.saved_to_pb(SaveResult(1, 1)) == pb.SaveResponse(num_saved=1, num_skipped=1)
    assert convert.saved_from_pb(pb.SaveResponse(num_saved=1, num_skipped=1)) == SaveResult(1, 1)
    assert convert.load_from_pb(convert.load_to_pb(blocks)) == blocks
    loaded = convert.loaded_to_pb(LoadResult(1, [H2]))
    assert loaded == pb.LoadResponse(num_loaded=1, failed_hashes=[H2])
    assert convert.loaded_from_pb(loaded) == LoadResult(1, [H2])


def test_stats_both_directions_every_field() -> None:
    fields = [f.name for f in dataclasses.fields(OffloadStats) if f.name not in ("pool_attached", "pool_generation")]
    stats = OffloadStats(**{name: i + 1 for i, name in enumerate(fields)}, pool_attached=True, pool_generation="g7")
    msg = convert.stats_to_pb(stats)
    wire = {f.name for f in pb.OffloadStats.DESCRIPTOR.fields}
    assert wire == {f.name for f in dataclasses.fields(OffloadStats)} - {"dropped"}  # dropped: not on the wire
    assert all(getattr(msg, name) == getattr(stats, name) for name in wire)
    assert convert.stats_from_pb(msg) == dataclasses.replace(stats, dropped=0)
