"""``kvmesh.v1.ModelRunner``: a thin adapter from protobuf to :class:`ModelRunner`.

Steps run one at a time under a lock (the model and the pool are not re-entrant), on the runner's
compute thread (compute_thread.py), not on the gRPC thread that took the call; a bad step raises
``InvalidArgument`` from the core before anything changed, and the runner keeps serving.

Incarnation: ``pool_id`` (the pool's generation, new at every start) is in ``GetModelInfo`` and in
every ``Execute`` reply, and a step naming another ``expected_pool_id`` is refused with
``FAILED_PRECONDITION`` before it runs: block ids planned against a dead runner's pool never read
this pool's (zeroed) blocks as if they were a cached prefix.

A step sent ahead (``after_step_id``, async scheduling) waits for the step it follows to run
(step_order.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TypeVar

import grpc

from services.model_runner.block_copy import copy_blocks
from services.model_runner.convert import model_info_to_proto, output_to_proto, step_from_proto
from services.model_runner.metrics import RunnerMetrics
from services.model_runner.runner import ModelRunner
from services.model_runner.step_order import StepOrder
from shared.errors import FailedPrecondition
from shared.grpc_server import ServiceName
from shared.pb.kvmesh.v1 import common_pb2, model_runner_pb2, model_runner_pb2_grpc
from shared.tensor_handle import handle_from_proto, handle_to_proto

T = TypeVar("T")

SERVICE = ServiceName.of("model-runner", model_runner_pb2, "ModelRunner")


class ModelRunnerServicer(model_runner_pb2_grpc.ModelRunnerServicer):
    """Serves one :class:`ModelRunner`."""

    def __init__(self, core: ModelRunner, metrics: RunnerMetrics | None = None) -> None:
        self.core = core
        self.metrics = metrics
        self._lock = threading.Lock()
        self._order = StepOrder(self._lock)

    def GetModelInfo(self, request: model_runner_pb2.GetModelInfoRequest, context: grpc.ServicerContext
                     ) -> model_runner_pb2.ModelInfo:
        return model_info_to_proto(self.core.model_info())

    def Warmup(self, request: model_runner_pb2.WarmupRequest, context: grpc.ServicerContext
               ) -> model_runner_pb2.WarmupResponse:
        with self._lock:
            return model_runner_pb2.WarmupResponse(seconds=self._compute(self.core.warmup))

    def Execute(self, request: model_runner_pb2.ExecuteRequest, context: grpc.ServicerContext
                ) -> model_runner_pb2.ExecuteResponse:
        step = step_from_proto(request)
        pool_id = self.core.pool.generation
        with self._lock:
            ok = False
            try:
                if request.after_step_id:  # sent ahead: runs right after the step it follows
                    self._order.wait_turn(request.after_step_id, context.time_remaining())
                if request.expected_pool_id and request.expected_pool_id != pool_id:
                    raise FailedPrecondition(f"pool incarnation mismatch: the step was planned for pool "
                                             f"{request.expected_pool_id}, this runner's is {pool_id}")
                if request.reset_requests:  # a (re)bound scheduler: forget every earlier request
                    step = dataclasses.replace(
                        step, finished_request_ids=(*self.core.request_ids, *step.finished_request_ids))
                out = self._compute(self.core.execute, step)
                ok = True
            finally:
                self._order.done(step.step_id, ok)
        if self.metrics is not None:
            tokens = sum(r.num_new_tokens for r in step.new_requests) + sum(
                r.num_new_tokens for r in step.cached_requests)
            self.metrics.observe_step(out.forward_seconds, tokens)
        reply = output_to_proto(out)
        reply.pool_id = pool_id
        return reply

    def _compute(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the runner's compute thread (compute_thread.py), where it has one."""
        compute = self.core.compute
        return fn(*args) if compute is None else compute.run(fn, *args)

    def GetKVPoolHandle(self, request: model_runner_pb2.GetKVPoolHandleRequest, context: grpc.ServicerContext
                        ) -> common_pb2.SharedTensorHandle:
        return handle_to_proto(self.core.pool.handle())

    def _copy(self, request: model_runner_pb2.CopyBlocksRequest, into_pool: bool
              ) -> model_runner_pb2.CopyBlocksResponse:
        num_bytes = copy_blocks(self.core.pool, handle_from_proto(request.staging), request.block_ids,
                                request.staging_rows, into_pool=into_pool, lock=self._lock)
        return model_runner_pb2.CopyBlocksResponse(num_blocks=len(request.block_ids), num_bytes=num_bytes)

    def CopyBlocksOut(self, request: model_runner_pb2.CopyBlocksRequest, context: grpc.ServicerContext
                      ) -> model_runner_pb2.CopyBlocksResponse:
        return self._copy(request, into_pool=False)

    def CopyBlocksIn(self, request: model_runner_pb2.CopyBlocksRequest, context: grpc.ServicerContext
                     ) -> model_runner_pb2.CopyBlocksResponse:
        return self._copy(request, into_pool=True)

