"""The model-runner as its one caller (the scheduler) sees it: a Protocol and its two adapters.

``RunnerBackend`` is what the engine needs: the model and pool it plans for (:class:`RunnerInfo`),
one ``execute`` per step (or ``submit``, which returns before the step has run, so that async
scheduling can send the next step while this one runs), the binding to one pool incarnation.
:class:`RemoteRunner` is it over gRPC (the suite); :class:`InProcessRunner` over the core in the
same process (the in-process engine), so the same engine runs in both modes. A runner that is
another incarnation than the one bound raises :class:`RunnerRestarted`, which the engine answers
by re-binding (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from services.model_runner.compute_thread import ComputeThread
from services.model_runner.config import RunnerConfig
from services.model_runner.convert import model_info_from_proto, output_from_proto, step_to_proto
from services.model_runner.factory import build_runner
from services.model_runner.runner import ModelRunner
from services.model_runner.types import ModelInfo, StepInput, StepOutput
from shared.channels import open_channel
from shared.errors import Unavailable
from shared.pb.kvmesh.v1 import common_pb2, model_runner_pb2, model_runner_pb2_grpc
from shared.telemetry import instrument_grpc_client

# How long an info probe waits for a (re)starting runner before it counts as down.
PROBE_SECONDS = 2.0


class RunnerRestarted(Unavailable):
    """The model-runner is another incarnation than the one the step was planned for: every block
    id and cached prefix of the old pool is meaningless now (the engine re-binds and recomputes)."""


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler must know about the served model and the pool (a view of ``ModelInfo``)."""

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
    kv_group_windows: tuple[int | None, ...] = (None,)  # per KV cache group its window, None = full
    kv_group_sink_tokens: tuple[int, ...] = ()  # per KV cache group its attention-sink tokens; empty = none

    @classmethod
    def from_model_info(cls, mi: ModelInfo) -> RunnerInfo:
        """The one place a ``RunnerInfo`` is built from what the runner reports."""
        return cls(
            model_id=mi.model_id, vocab_size=mi.vocab_size, max_model_len=mi.max_model_len,
            eos_token_ids=tuple(mi.eos_token_ids), num_blocks=mi.num_blocks, block_size=mi.block_size,
            pool_id=mi.pool_id, dtype=mi.dtype, attention_backend=mi.attention_backend,
            dtype_reason=mi.dtype_reason, attention_backend_reason=mi.attention_backend_reason,
            kv_group_windows=mi.kv_group_windows, kv_group_sink_tokens=mi.kv_group_sink_tokens,
        )


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

    def submit(self, step: StepInput) -> Callable[[], StepOutput]:
        """Starts a step and returns at once; calling the result waits for the step's output and
        raises what :meth:`execute` would. A step with ``after_step_id`` set runs right after that
        step, and only if it ran."""
        ...

    def bind(self, pool_id: str) -> None:
        """Expects incarnation ``pool_id`` from now on; the next step makes the runner forget every
        request it knew (they belonged to an earlier binding)."""
        ...

    def pool_handle(self) -> Any:
        """The pool's shared-memory handle, for the offload-store."""
        ...


class InProcessRunner:
    """Over a :class:`ModelRunner` in this process (no gRPC)."""

    def __init__(self, core: ModelRunner) -> None:
        self.core = core
        # One thread: submitted steps run one at a time in submission order, so a step sent ahead
        # runs right after the one it follows (whose failure leaves the runner's state unchanged,
        # so the step sent ahead is then refused by the runner's own validation). The core's
        # compute thread where the factory gave it one (sized and bound), else a plain one.
        self._own: ComputeThread | None = None

    @classmethod
    def from_config(cls, config: RunnerConfig) -> InProcessRunner:
        """Builds the core as the service does (``factory.build_runner``)."""
        return cls(build_runner(config))

    def info(self) -> RunnerInfo:
        return RunnerInfo.from_model_info(self.core.model_info())

    def execute(self, step: StepInput) -> StepOutput:
        return self._thread().run(self.core.execute, step)

    def submit(self, step: StepInput) -> Callable[[], StepOutput]:
        return self._thread().submit(self.core.execute, step).result

    def _thread(self) -> ComputeThread:
        if self.core.compute is not None:
            return self.core.compute
        if self._own is None:
            self._own = ComputeThread(0)
        return self._own

    def close(self) -> None:
        """Ends a step thread of its own (after the step it runs, if any); the core's compute
        thread is the core's, which may serve another engine after this one."""
        if self._own is not None:
            self._own.close()
            self._own = None

    def bind(self, pool_id: str) -> None:
        return None  # one process: the pool cannot restart under the engine

    def pool_handle(self) -> Any:
        return self.core.pool.handle()


class RemoteRunner:
    """The model-runner over gRPC: one ``Execute`` call per step."""

    def __init__(self, address: str, timeout: float = 60.0) -> None:
        self.channel = instrument_grpc_client(open_channel(address))
        self.stub = model_runner_pb2_grpc.ModelRunnerStub(self.channel)
        self.timeout = timeout
        self.pool_id = ""  # the incarnation steps are planned for (bind)
        self._reset_next = False

    def info(self) -> RunnerInfo:
        # NOTE: waits briefly for a (re)starting runner instead of failing at once in reconnect backoff.
        msg = self.stub.GetModelInfo(model_runner_pb2.GetModelInfoRequest(), timeout=min(self.timeout, PROBE_SECONDS),
                                     wait_for_ready=True)
        return RunnerInfo.from_model_info(model_info_from_proto(msg))

    def bind(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self._reset_next = True

    def execute(self, step: StepInput) -> StepOutput:
        return self.submit(step)()

    def submit(self, step: StepInput) -> Callable[[], StepOutput]:
        msg = step_to_proto(step)
        msg.expected_pool_id = self.pool_id
        # NOTE: a step sent ahead never resets: the step it follows came first and did, if needed.
        msg.reset_requests = self._reset_next and not step.after_step_id
        call = self.stub.Execute.future(msg, timeout=self.timeout)

        def wait() -> StepOutput:
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise RunnerRestarted(f"model-runner: {exc.details()}") from exc
                raise
            if reply.pool_id != self.pool_id:
                raise RunnerRestarted(f"model-runner pool {reply.pool_id} ran a step planned for {self.pool_id}")
            self._reset_next = False
            return output_from_proto(reply)

        return wait

    def pool_handle(self) -> common_pb2.SharedTensorHandle:
        """The KV pool's shared-memory handle (passed on to the offload-store)."""
        return self.stub.GetKVPoolHandle(model_runner_pb2.GetKVPoolHandleRequest(), timeout=self.timeout)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()
