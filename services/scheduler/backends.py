"""What the scheduler needs from the kv-cache-manager and the model-runner, as two Protocols.

The gRPC suite plugs in the remote adapters (``services.scheduler.remote``); the in-process engine
and the scheduler's unit tests plug in the real cores directly (``InProcessKVCache`` /
``InProcessRunner`` here), so the same scheduling code runs in both modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import AllocationSpec, KVCacheStats, StepResult
from services.model_runner.types import StepInput, StepOutput
from shared.config import CacheConfig
from shared.errors import Unavailable


class RunnerRestarted(Unavailable):
    """The model-runner is another incarnation than the one the step was planned for: every block
    id and cached prefix of the old pool is meaningless now (the engine re-binds and recomputes)."""


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler must know about the served model and the pool."""

    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int  # including the null block
    block_size: int
    pool_id: str = ""  # the runner's pool incarnation (new at every runner start)
    dtype: str = ""  # the runner's choices and why (ModelInfo), for GetModelInfo
    attention_backend: str = ""
    dtype_reason: str = ""
    attention_backend_reason: str = ""


class KVCacheBackend(Protocol):
    """The kv-cache-manager as the scheduler sees it: one call per step."""

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        """Frees (rolling back ``rollback_request_ids``), then allocates in order (``AllocateSlots``)."""
        ...

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        """Frees requests outside a step (idle engine, requests refused after allocation)."""
        ...

    def initialize(self, config: CacheConfig, pool_id: str) -> bool:
        """Binds the manager to this scheduler: the runner's geometry, the scheduler's seed, the
        runner's pool incarnation. Every live request is freed; returns whether the cache was kept.

        Raises:
            FailedPrecondition: another scheduler still owns the manager.
        """
        ...

    def keepalive(self) -> None:
        """Renews this scheduler's ownership while idle (raises FailedPrecondition when lost)."""
        ...


class RunnerBackend(Protocol):
    """The model-runner as the scheduler sees it: one call per step."""

    def info(self) -> RunnerInfo:
        """Model and pool geometry."""
        ...

    def execute(self, step: StepInput) -> StepOutput:
        """Runs one step and returns the sampled tokens.

        Raises:
            RunnerRestarted: the runner is not the incarnation last passed to :meth:`bind`.
        """
        ...

    def bind(self, pool_id: str) -> None:
        """Expects incarnation ``pool_id`` from now on; the next step makes the runner forget every
        request it knew (they belonged to an earlier binding)."""
        ...

    def pool_handle(self) -> Any:
        """The pool's shared-memory handle, for the offload-store."""
        ...


class InProcessKVCache:
    """Adapter over an in-process ``KVCacheManager`` core (no gRPC, no owner: one process).

    ``manager`` may be None: the first :meth:`initialize` then creates it, as a bare
    kv-cache-manager service waits for its scheduler's ``Initialize``.
    """

    def __init__(self, manager: Any = None) -> None:
        self.manager = manager

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        result: StepResult = self.manager.step(list(free_request_ids), list(allocations),
                                               list(rollback_request_ids))
        return result

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        return self.step(request_ids, [], rollback_request_ids).stats

    def initialize(self, config: CacheConfig, pool_id: str) -> bool:
        if self.manager is None:
            self.manager = KVCacheManager(config)
            return False
        _, kept, _ = self.manager.initialize(config, keep_cache=True)
        return bool(kept)

    def keepalive(self) -> None:
        return None


class InProcessRunner:
    """Adapter over an in-process ``ModelRunnerCore`` (no gRPC)."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def info(self) -> RunnerInfo:
        mi = self.core.model_info()
        return RunnerInfo(
            model_id=mi.model_id, vocab_size=mi.vocab_size, max_model_len=mi.max_model_len,
            eos_token_ids=tuple(mi.eos_token_ids), num_blocks=mi.num_blocks, block_size=mi.block_size,
            pool_id=self.core.pool.generation,
            dtype=mi.dtype, attention_backend=mi.attention_backend, dtype_reason=mi.dtype_reason,
            attention_backend_reason=mi.attention_backend_reason,
        )

    def execute(self, step: StepInput) -> StepOutput:
        out: StepOutput = self.core.execute(step)
        return out

    def bind(self, pool_id: str) -> None:
        return None  # one process: the pool cannot restart under the engine

    def pool_handle(self) -> Any:
        return self.core.pool.handle()
