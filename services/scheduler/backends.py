"""What the scheduler needs from the kv-cache-manager and the model-runner, as two Protocols.

The gRPC suite plugs in the remote adapters (``services.scheduler.remote``); the in-process engine
and the scheduler's unit tests plug in the real cores directly (``InProcessKVCache`` /
``InProcessRunner`` here), so the same scheduling code runs in both modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.kv_cache_manager.types import AllocationSpec, KVCacheStats, StepResult
from services.model_runner.types import StepInput, StepOutput


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler must know about the served model and the pool."""

    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int  # including the null block
    block_size: int
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

    def initialize(self, num_blocks: int, block_size: int, max_model_len: int, model_id: str) -> None:
        """Sizes the pool to match the runner's."""
        ...


class RunnerBackend(Protocol):
    """The model-runner as the scheduler sees it: one call per step."""

    def info(self) -> RunnerInfo:
        """Model and pool geometry."""
        ...

    def execute(self, step: StepInput) -> StepOutput:
        """Runs one step and returns the sampled tokens."""
        ...


class InProcessKVCache:
    """Adapter over an in-process ``KVCacheManager`` core (no gRPC)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def step(self, free_request_ids: Sequence[str], allocations: Sequence[AllocationSpec],
             rollback_request_ids: Sequence[str] = ()) -> StepResult:
        result: StepResult = self.manager.step(list(free_request_ids), list(allocations),
                                               list(rollback_request_ids))
        return result

    def free(self, request_ids: Sequence[str], rollback_request_ids: Sequence[str] = ()) -> KVCacheStats:
        return self.step(request_ids, [], rollback_request_ids).stats

    def initialize(self, num_blocks: int, block_size: int, max_model_len: int, model_id: str) -> None:
        self.manager.initialize(num_blocks=num_blocks, block_size=block_size,
                                max_model_len=max_model_len, model_id=model_id)


class InProcessRunner:
    """Adapter over an in-process ``ModelRunnerCore`` (no gRPC)."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def info(self) -> RunnerInfo:
        mi = self.core.model_info()
        return RunnerInfo(
            model_id=mi.model_id, vocab_size=mi.vocab_size, max_model_len=mi.max_model_len,
            eos_token_ids=tuple(mi.eos_token_ids), num_blocks=mi.num_blocks, block_size=mi.block_size,
            dtype=mi.dtype, attention_backend=mi.attention_backend, dtype_reason=mi.dtype_reason,
            attention_backend_reason=mi.attention_backend_reason,
        )

    def execute(self, step: StepInput) -> StepOutput:
        out: StepOutput = self.core.execute(step)
        return out
