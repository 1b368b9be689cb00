"""``kvmesh.v1.ModelRunner``: a thin adapter from protobuf to :class:`ModelRunner`.

Steps, warm-ups and block copies run one at a time, in the order they were queued, on the runner's
compute thread (compute_thread.py), not on the gRPC thread that took the call: the model and the
pool are not re-entrant, and that one thread is what keeps them apart. A bad step raises
``InvalidArgument`` from the core before anything changed, and the runner keeps serving.

Incarnation: ``pool_id`` (the pool's generation, new at every start) is in ``GetModelInfo`` and in
every ``Execute`` reply, and a step naming another ``expected_pool_id`` is refused with
``FAILED_PRECONDITION`` before it runs: block ids planned against a dead runner's pool never read
this pool's (zeroed) blocks as if they were a cached prefix.

A step sent ahead (``after_step_id``, async scheduling) is queued right behind the step it follows
and runs only if that one succeeded (step_order.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TypeVar

import grpc

from services.model_runner.block_copy import copy_blocks
from services.model_runner.compute_thread import ComputeThread
from services.model_runner.convert import model_info_to_proto, output_to_proto, step_from_proto
from services.model_runner.metrics import RunnerMetrics
from services.model_runner.runner import ModelRunner
from services.model_runner.step_order import StepOrder
from services.model_runner.types import StepInput, StepOutput
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
        self._lock = threading.Lock()  # the order of queueing, not the work itself
        self._order = StepOrder(self._lock)
        # a core built without the factory has no compute thread: one of our own keeps the work serial
        self._compute = core.compute if core.compute is not None else ComputeThread(0)

    def GetModelInfo(self, request: model_runner_pb2.GetModelInfoRequest, context: grpc.ServicerContext
                     ) -> model_runner_pb2.ModelInfo:
        return model_info_to_proto(self.core.model_info())

    def Warmup(self, request: model_runner_pb2.WarmupRequest, context: grpc.ServicerContext
               ) -> model_runner_pb2.WarmupResponse:
        return model_runner_pb2.WarmupResponse(seconds=self._submit(self.core.warmup).result())

    def Execute(self, request: model_runner_pb2.ExecuteRequest, context: grpc.ServicerContext
                ) -> model_runner_pb2.ExecuteResponse:
        step = step_from_proto(request)
        with self._lock:
            deadline, refused = 0.0, None
            if request.after_step_id:  # sent ahead: queued right behind the step it follows
                try:
                    deadline = self._order.wait_queued(request.after_step_id, context.time_remaining())
                except FailedPrecondition as exc:  # queued all the same, as a failed step: the
                    refused = exc                   # step sent behind this one is refused at once
            done = self._submit(self._run_step, request, step, deadline, refused)
            self._order.queued(step.step_id)
        out = done.result()
        if self.metrics is not None:
            tokens = sum(r.num_new_tokens for r in step.new_requests) + sum(
                r.num_new_tokens for r in step.cached_requests)
            self.metrics.observe_step(out.forward_seconds, tokens)
        reply = output_to_proto(out)
        reply.pool_id = self.core.pool.generation
        return reply

    def _run_step(self, request: model_runner_pb2.ExecuteRequest, step: StepInput, deadline: float,
                  refused: FailedPrecondition | None) -> StepOutput:
        """One step, on the compute thread: refused unless the step it follows (if any) was queued
        in time (``refused`` None), ran and succeeded, and the pool is the one the step was
        planned for."""
        ok = False
        try:
            if refused is not None:
                raise refused
            if request.after_step_id:
                self._order.check_turn(request.after_step_id, deadline)
            pool_id = self.core.pool.generation
            if request.expected_pool_id and request.expected_pool_id != pool_id:
                raise FailedPrecondition(f"pool incarnation mismatch: the step was planned for pool "
                                         f"{request.expected_pool_id}, this runner's is {pool_id}")
            if request.reset_requests:  # a (re)bound scheduler: forget every earlier request
                step = dataclasses.replace(
                    step, finished_request_ids=(*self.core.request_ids, *step.finished_request_ids))
            out = self.core.execute(step)
            ok = True
            return out
        finally:
            self._order.ran(step.step_id, ok)

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Queues ``fn(*args)`` on the runner's compute thread (compute_thread.py), behind what was
        queued before it."""
        return self._compute.submit(fn, *args)

    def GetKVPoolHandle(self, request: model_runner_pb2.GetKVPoolHandleRequest, context: grpc.ServicerContext
                        ) -> common_pb2.SharedTensorHandle:
        return handle_to_proto(self.core.pool.handle())

    def _copy(self, request: model_runner_pb2.CopyBlocksRequest, into_pool: bool
              ) -> model_runner_pb2.CopyBlocksResponse:
        copy = partial(copy_blocks, into_pool=into_pool)
        num_bytes = self._submit(copy, self.core.pool, handle_from_proto(request.staging), request.block_ids,
                                 request.staging_rows).result()
        return model_runner_pb2.CopyBlocksResponse(num_blocks=len(request.block_ids), num_bytes=num_bytes)

    def CopyBlocksOut(self, request: model_runner_pb2.CopyBlocksRequest, context: grpc.ServicerContext
                      ) -> model_runner_pb2.CopyBlocksResponse:
        return self._copy(request, into_pool=False)

    def CopyBlocksIn(self, request: model_runner_pb2.CopyBlocksRequest, context: grpc.ServicerContext
                     ) -> model_runner_pb2.CopyBlocksResponse:
        return self._copy(request, into_pool=True)

