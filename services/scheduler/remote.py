"""gRPC adapters: the kv-cache-manager and model-runner backends over their generated stubs.

Each method is one RPC with a deadline; errors surface as ``grpc.RpcError`` and the engine turns
them into ended streams, except the two that mean "the other side is not the one we bound":
``FAILED_PRECONDITION`` from the kv-cache-manager (restarted: not initialized; or another owner)
becomes :class:`shared.errors.FailedPrecondition`, and a runner that is another incarnation
becomes :class:`RunnerRestarted`. The engine answers both by re-binding (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc

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
from services.scheduler.backends import RunnerInfo, RunnerRestarted
from shared.channels import open_channel
from shared.config import CacheConfig
from shared.errors import FailedPrecondition
from shared.hashing import BlockHash
from shared.ownership import OWNER_METADATA
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

# How long a probe (info, keep-alive) waits for a peer to (re)connect before it counts as down.
PROBE_SECONDS = 2.0


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
        is_new=a.is_new, use_prefix_cache=a.use_prefix_cache,
        is_resumed=a.is_resumed, num_external_blocks=a.num_external_blocks, block_hashes=a.block_hashes,
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


@contextmanager
def _precondition_as_error() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise FailedPrecondition(f"kv-cache-manager: {exc.details()}") from exc
        raise


class RemoteKVCache:
    """The kv-cache-manager over gRPC: one ``AllocateSlots`` call per step.

    Args:
        address: ``host:port``.
        timeout: deadline of each call.
        owner_id: this scheduler incarnation, sent as ``kvmesh-owner`` metadata on every call.
        lease_seconds: how long the manager keeps this owner without a call.
    """

    def __init__(self, address: str, timeout: float = 60.0, owner_id: str = "",
                 lease_seconds: float = 10.0) -> None:
        self.channel = instrument_grpc_client(open_channel(address))
        self.stub = kvm_grpc.KVCacheManagerStub(self.channel)
        self.timeout = timeout
        self.metadata = ((OWNER_METADATA, owner_id),)
        self.lease_seconds = lease_seconds
        self.instance_id = ""  # the manager process last bound

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        with _precondition_as_error():
            resp = self.stub.AllocateSlots(
                kvm_pb2.AllocateSlotsRequest(
                    free_request_ids=list(free_request_ids),
                    allocations=[_allocation_to_proto(a) for a in allocations],
                    rollback_request_ids=list(rollback_request_ids),
                ),
                timeout=self.timeout, metadata=self.metadata,
            )
        if resp.stats.instance_id != self.instance_id:  # cannot happen unless bound elsewhere
            raise FailedPrecondition(f"kv-cache-manager instance {resp.stats.instance_id} is not the one bound")
        return StepResult(
            results=tuple(_result_from_proto(r) for r in resp.results),
            evicted=tuple(EvictedBlock(e.block_id, BlockHash(e.block_hash)) for e in resp.evicted),
            stats=_stats_from_proto(resp.stats),
        )

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        with _precondition_as_error():
            resp = self.stub.Free(kvm_pb2.FreeRequest(request_ids=list(request_ids),
                                                      rollback_request_ids=list(rollback_request_ids)),
                                  timeout=self.timeout, metadata=self.metadata)
        return _stats_from_proto(resp.stats)

    def initialize(self, config: CacheConfig, pool_id: str) -> bool:
        with _precondition_as_error():
            resp = self.stub.Initialize(
                kvm_pb2.InitializeRequest(num_blocks=config.num_blocks, block_size=config.block_size,
                                          max_model_len=config.max_model_len, model_id=config.model_id,
                                          pool_id=pool_id,
                                          lease_seconds=self.lease_seconds),
                timeout=self.timeout, metadata=self.metadata,
            )
        self.instance_id = resp.stats.instance_id
        return bool(resp.kept_cache)

    def keepalive(self) -> None:
        # An owner call renews the lease; it waits briefly for a restarted manager to be reachable.
        with _precondition_as_error():
            self.stub.Free(kvm_pb2.FreeRequest(), timeout=min(self.timeout, PROBE_SECONDS), metadata=self.metadata,
                           wait_for_ready=True)

    def release(self) -> None:
        """Clean exit: frees this scheduler's requests and ends its ownership at once."""
        self.stub.Release(kvm_pb2.ReleaseRequest(), timeout=self.timeout, metadata=self.metadata)

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
        self.pool_id = ""  # the incarnation steps are planned for (bind)
        self._reset_next = False

    def info(self) -> RunnerInfo:
        # NOTE: waits briefly for a (re)starting runner instead of failing at once in reconnect backoff.
        mi = self.stub.GetModelInfo(runner_pb2.GetModelInfoRequest(), timeout=min(self.timeout, PROBE_SECONDS),
                                    wait_for_ready=True)
        return RunnerInfo(
            model_id=mi.model_id, vocab_size=mi.vocab_size, max_model_len=mi.max_model_len,
            eos_token_ids=tuple(mi.eos_token_ids), num_blocks=mi.num_blocks, block_size=mi.block_size,
            pool_id=mi.pool_id,
            dtype=mi.dtype, attention_backend=mi.attention_backend, dtype_reason=mi.dtype_reason,
            attention_backend_reason=mi.attention_backend_reason,
        )

    def bind(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self._reset_next = True

    def execute(self, step: StepInput) -> StepOutput:
        msg = step_to_proto(step)
        msg.expected_pool_id = self.pool_id
        msg.reset_requests = self._reset_next
        try:
            reply = self.stub.Execute(msg, timeout=self.timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RunnerRestarted(f"model-runner: {exc.details()}") from exc
            raise
        if reply.pool_id != self.pool_id:
            raise RunnerRestarted(f"model-runner pool {reply.pool_id} ran a step planned for {self.pool_id}")
        self._reset_next = False
        return output_from_proto(reply)

    def pool_handle(self) -> common_pb2.SharedTensorHandle:
        """The KV pool's shared-memory handle (passed on to the offload-store)."""
        return self.stub.GetKVPoolHandle(runner_pb2.GetKVPoolHandleRequest(), timeout=self.timeout)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()
