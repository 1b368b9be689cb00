"""gRPC adapters: the kv-cache-manager and model-runner backends over their generated stubs.

Each method is one RPC with a deadline; errors surface as ``grpc.RpcError`` and the engine turns
them into ended streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.kv_cache_manager.types import (
    AllocationResult,
    AllocationSpec,
    AllocationStatus,
    EvictedBlock,
    KVCacheStats,
    StepResult,
)
from services.model_runner.convert import output_from_proto, step_to_proto
from services.model_runner.types import StepInput, StepOutput
from services.scheduler.backends import RunnerInfo
from shared.channels import open_channel
from shared.errors import FailedPrecondition
from shared.hashing import BlockHash, hash_blocks
from shared.pb.kvmesh.v1 import common_pb2
from shared.pb.kvmesh.v1 import (
    kv_cache_manager_pb2 as kvm_pb2,
)
from shared.pb.kvmesh.v1 import (
    kv_cache_manager_pb2_grpc as kvm_grpc,
)
from shared.pb.kvmesh.v1 import (
    model_runner_pb2 as runner_pb2,
)
from shared.pb.kvmesh.v1 import (
    model_runner_pb2_grpc as runner_grpc,
)
from shared.telemetry import instrument_grpc_client


def _stats_from_proto(s: kvm_pb2.KVCacheStats) -> KVCacheStats:
    return KVCacheStats(
        num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks, num_cached_blocks=s.num_cached_blocks,
        usage_percent=s.usage_percent, prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits, recompute_queries=s.recompute_queries,
        recompute_hits=s.recompute_hits, num_requests=s.num_requests, block_size=s.block_size,
        num_evictions=s.num_evictions,
    )


def _allocation_to_proto(a: AllocationSpec) -> kvm_pb2.Allocation:
    return kvm_pb2.Allocation(
        request_id=a.request_id, new_token_ids=a.new_token_ids, num_new_tokens=a.num_new_tokens,
        is_new=a.is_new, cache_salt=a.cache_salt, use_prefix_cache=a.use_prefix_cache,
        is_resumed=a.is_resumed, num_external_blocks=a.num_external_blocks,
    )


def _result_from_proto(r: kvm_pb2.AllocationResult) -> AllocationResult:
    return AllocationResult(
        request_id=r.request_id,
        status=AllocationStatus.OK if r.status == kvm_pb2.AllocationResult.STATUS_OK
        else AllocationStatus.OUT_OF_BLOCKS,
        new_block_ids=tuple(r.new_block_ids), num_computed_tokens=r.num_computed_tokens,
        num_new_tokens=r.num_new_tokens, num_cached_tokens=r.num_cached_tokens,
        external_block_ids=tuple(r.external_block_ids),
    )


class RemoteKVCache:
    """The kv-cache-manager over gRPC: one ``AllocateSlots`` call per step."""

    def __init__(self, address: str, timeout: float = 60.0) -> None:
        self.channel = instrument_grpc_client(open_channel(address))
        self.stub = kvm_grpc.KVCacheManagerStub(self.channel)
        self.timeout = timeout

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        resp = self.stub.AllocateSlots(
            kvm_pb2.AllocateSlotsRequest(
                free_request_ids=list(free_request_ids),
                allocations=[_allocation_to_proto(a) for a in allocations],
                rollback_request_ids=list(rollback_request_ids),
            ),
            timeout=self.timeout,
        )
        return StepResult(
            results=tuple(_result_from_proto(r) for r in resp.results),
            evicted=tuple(EvictedBlock(e.block_id, BlockHash(e.block_hash)) for e in resp.evicted),
            stats=_stats_from_proto(resp.stats),
        )

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        resp = self.stub.Free(kvm_pb2.FreeRequest(request_ids=list(request_ids),
                                                  rollback_request_ids=list(rollback_request_ids)),
                              timeout=self.timeout)
        return _stats_from_proto(resp.stats)

    def initialize(self, num_blocks: int, block_size: int, max_model_len: int, model_id: str) -> None:
        self.stub.Initialize(
            kvm_pb2.InitializeRequest(num_blocks=num_blocks, block_size=block_size,
                                      max_model_len=max_model_len, model_id=model_id),
            timeout=self.timeout,
        )

    def stats(self) -> KVCacheStats:
        """Current pool statistics."""
        return _stats_from_proto(self.stub.GetStats(kvm_pb2.GetStatsRequest(), timeout=self.timeout))

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()


class RemoteRunner:
    """The model-runner over gRPC: one ``Execute`` call per step."""

    def __init__(self, address: str, timeout: float = 60.0) -> None:
        self.channel = instrument_grpc_client(open_channel(address))
        self.stub = runner_grpc.ModelRunnerStub(self.channel)
        self.timeout = timeout

    def info(self) -> RunnerInfo:
        mi = self.stub.GetModelInfo(runner_pb2.GetModelInfoRequest(), timeout=self.timeout)
        return RunnerInfo(
            model_id=mi.model_id, vocab_size=mi.vocab_size, max_model_len=mi.max_model_len,
            eos_token_ids=tuple(mi.eos_token_ids), num_blocks=mi.num_blocks, block_size=mi.block_size,
            dtype=mi.dtype, attention_backend=mi.attention_backend, dtype_reason=mi.dtype_reason,
            attention_backend_reason=mi.attention_backend_reason,
        )

    def execute(self, step: StepInput) -> StepOutput:
        return output_from_proto(self.stub.Execute(step_to_proto(step), timeout=self.timeout))

    def pool_handle(self) -> common_pb2.SharedTensorHandle:
        """The KV pool's shared-memory handle (passed on to the offload-store)."""
        return self.stub.GetKVPoolHandle(runner_pb2.GetKVPoolHandleRequest(), timeout=self.timeout)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()


def check_hash_seed(kv: RemoteKVCache, engine: Any) -> None:
    """Refuses to start when the scheduler's prefix hashes differ from the kv-cache-manager's.

    Offload-store keys come from both sides (the scheduler hashes prompts for lookups, the manager
    reports evicted blocks' hashes for saves), so a deployment-key mismatch would silently turn
    every offload lookup into a miss.
    """
    probe = list(range(engine.info.block_size))
    theirs = list(kv.stub.LookupPrefix(kvm_pb2.LookupPrefixRequest(token_ids=probe), timeout=kv.timeout).block_hashes)
    ours = hash_blocks(engine.scheduler.hash_seed, probe, engine.info.block_size)
    if theirs != ours:
        raise FailedPrecondition(
            "prefix-hash seed mismatch between scheduler and kv-cache-manager: set the same deployment key "
            "(KVMESH_DEPLOYMENT_KEY for both)")
