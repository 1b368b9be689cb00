"""One mapping of a shared tensor handle: the runner's ``kv_pool.attach`` and the offload-store's
``pool_mapping.map_pool`` give the same error (type and message) for the same fault, because both
map through ``shared.tensor_handle.map_handle``."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.model_runner.kv_pool import KVPool, attach
from services.offload_store.pool_mapping import map_pool
from shared.errors import FailedPrecondition, InvalidArgument, KVMeshError, NotFound
from shared.tensor_handle import KIND_CUDA_IPC, SharedTensorHandle, map_handle

IPC_FIELDS = (b'{"handle": {"b64": ""}, "size_bytes": 1024, "offset_bytes": 0, "ref_counter_handle": '
              b'{"b64": ""}, "ref_counter_offset": 0, "event_handle": null, "event_sync_required": false}')


@pytest.fixture
def pool() -> Iterator[KVPool]:
    with KVPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, memory_bytes=8 * 1024,
                dtype=torch.float16) as p:
        yield p


def _error(mapping: Callable[[], object]) -> KVMeshError:
    with pytest.raises(KVMeshError) as err:
        mapping()
    return err.value


def _both(handle: SharedTensorHandle, allowed_dir: str) -> tuple[KVMeshError, KVMeshError]:
    return _error(lambda: attach(handle)), _error(lambda: map_pool(handle, allowed_dir))


def _faults(pool: KVPool) -> dict[str, tuple[SharedTensorHandle, type[KVMeshError], str]]:
    good = pool.handle()
    return {
        "unknown dtype": (dataclasses.replace(good, dtype="float17"), InvalidArgument, "unknown dtype 'float17'"),
        "nbytes vs shape": (dataclasses.replace(good, nbytes=good.nbytes * 2), InvalidArgument,
                            f"handle nbytes {good.nbytes * 2} != {good.nbytes} implied by shape"),
        "unknown kind": (dataclasses.replace(good, kind="nfs"), InvalidArgument, "unknown shared tensor kind 'nfs'"),
        "relative path": (dataclasses.replace(good, path="pool.kv"), InvalidArgument, "must be absolute"),
        "missing file": (dataclasses.replace(good, path=good.path + ".gone"), NotFound, "does not exist"),
        "malformed ipc": (dataclasses.replace(good, kind=KIND_CUDA_IPC, cuda_ipc_handle=b"not json"),
                          InvalidArgument, "malformed cuda_ipc_handle"),
    }


@pytest.mark.parametrize("fault", ["unknown dtype", "nbytes vs shape", "unknown kind", "relative path",
                                   "missing file", "malformed ipc"])
def test_the_same_fault_is_the_same_error_on_both_sides(pool: KVPool, fault: str) -> None:
    handle, kind, text = _faults(pool)[fault]
    runner, store = _both(handle, os.path.dirname(pool.handle().path))
    assert type(runner) is type(store) is kind
    assert str(runner) == str(store)
    assert text in str(runner)


def test_a_file_of_another_size_is_failed_precondition_on_both_sides(pool: KVPool) -> None:
    handle = pool.handle()
    os.truncate(handle.path, handle.nbytes - 1)
    runner, store = _both(handle, os.path.dirname(handle.path))
    assert type(runner) is type(store) is FailedPrecondition
    assert str(runner) == str(store) == (f"shared tensor file {handle.path!r} holds {handle.nbytes - 1} bytes, "
                                         f"the handle says {handle.nbytes}")


def test_a_closed_pool_is_not_found_on_both_sides() -> None:
    closed = KVPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, memory_bytes=8 * 1024,
                    dtype=torch.float16)
    handle = closed.handle()
    closed.close()
    runner, store = _both(handle, os.path.dirname(handle.path))
    assert type(runner) is type(store) is NotFound
    assert str(runner) == str(store)


def test_a_directory_is_not_a_pool_file(pool: KVPool, tmp_path: os.PathLike[str]) -> None:
    handle = dataclasses.replace(pool.handle(), path=str(tmp_path))
    runner, store = _both(handle, os.path.dirname(str(tmp_path)))
    assert type(runner) is type(store) is InvalidArgument
    assert str(runner) == str(store) == f"shared tensor file {str(tmp_path)!r} is not a regular file"


def test_the_allowed_directory_is_enforced(pool: KVPool, tmp_path: os.PathLike[str]) -> None:
    handle = pool.handle()
    with pytest.raises(InvalidArgument, match="not in the allowed directory"):
        map_handle(handle, str(tmp_path))
    assert map_handle(handle).numel() == handle.nbytes  # no directory given: any absolute file


def test_mapped_bytes_are_the_pool(pool: KVPool) -> None:
    pool.tensor[1, 0, 3] = 0.5
    typed = attach(pool.handle())
    assert typed.dtype == torch.float16 and tuple(typed.shape) == tuple(pool.tensor.shape)
    assert torch.equal(typed, pool.tensor)
    assert torch.equal(map_handle(pool.handle()), pool.tensor.view(-1).view(torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_ipc_without_cuda_is_failed_precondition_on_both_sides(pool: KVPool) -> None:
    handle = dataclasses.replace(pool.handle(), kind=KIND_CUDA_IPC, path="", cuda_ipc_handle=IPC_FIELDS,
                                 device_index=0)
    runner, store = _both(handle, "/dev/shm")
    assert type(runner) is type(store) is FailedPrecondition
    assert str(runner) == str(store) == "a cuda_ipc handle needs CUDA in the mapping process"


_CUDA_CHILD = """
import base64, json, sys, torch
from services.model_runner.kv_pool import attach
from services.offload_store.pool_mapping import map_pool
from shared.tensor_handle import SharedTensorHandle
f = json.loads(sys.argv[1])
h = SharedTensorHandle(**{**f, "shape": tuple(f["shape"]), "cuda_ipc_handle": base64.b64decode(f["cuda_ipc_handle"])})
typed = attach(h)
mapped = map_pool(h, "/dev/shm")
seen = typed[1, 0, 3].float().sum().item()
mapped.block(5).fill_(0)  # zero bytes are 0.0 in float16
typed[0, 1, 2, 1] = 7.0
torch.cuda.synchronize()
print(json.dumps({"seen": seen, "same": mapped.raw.data_ptr() == typed.data_ptr()}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a device run)")
def test_a_cuda_pool_maps_in_another_process_through_both_sides() -> None:
    with KVPool(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, memory_bytes=8 * 1024,
                dtype=torch.float16, device="cuda") as pool:
        pool.tensor.fill_(1.0)
        fields = dataclasses.asdict(pool.handle())
        fields["cuda_ipc_handle"] = base64.b64encode(fields["cuda_ipc_handle"]).decode()
        torch.cuda.synchronize()
        out = subprocess.run([sys.executable, "-c", _CUDA_CHILD, json.dumps(fields)], capture_output=True,
                             text=True, check=True, timeout=300, cwd=Path(__file__).parents[3])
        # K of block 3 in layer 1: 4 tokens x 2 heads x 8 dims of 1.0; both mappings share one storage
        assert json.loads(out.stdout) == {"seen": 64.0, "same": True}
        assert (pool.tensor[:, :, 5] == 0).all()
        assert (pool.tensor[0, 1, 2, 1] == 7.0).all()
