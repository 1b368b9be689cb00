"""The keep-alive calls a peer only when no step renewed its lease within the interval.

A real kv-cache-manager (servicer on a gRPC server in this process) behind the scheduler's real
remote adapter, a real in-process runner, and the engine: every RPC the kv-cache-manager receives
is counted. The engine's keep-alive clock is the test's: it moves one whole keep-alive interval
per model step, so each step alone would make a keep-alive due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.kv_cache_manager.binding import ManagerBinding
from services.kv_cache_manager.client import RemoteKVCache
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.servicer import SERVICE, KVCacheManagerServicer
from services.model_runner.client import InProcessRunner
from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner
from services.model_runner.types import StepInput, StepOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine
from services.scheduler.stream import OutputStream, build_spec
from shared.config import ServerConfig
from shared.grpc_server import ServiceRegistration, start_server
from shared.interceptors import wrap_handler
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from shared.sampling_params import SamplingParams

LEASE = 3.0
INTERVAL = LEASE / 3


class Clock:
    """The engine's keep-alive clock, moved by the test only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SteppingRunner(InProcessRunner):
    """The real in-process runner; sending each step also moves the clock one keep-alive interval
    (at the send, in the engine's thread, so what the engine sees next is deterministic)."""

    def __init__(self, core: Any, clock: Clock) -> None:
        super().__init__(core)
        self.clock = clock

    def submit(self, step: StepInput) -> Callable[[], StepOutput]:
        wait = super().submit(step)
        self.clock.now += INTERVAL
        return wait


class CallCounter(grpc.ServerInterceptor):  # type: ignore[misc]
    """Counts every call by method; an empty ``Free`` is the keep-alive."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def count(self, name: str) -> int:
        with self._lock:
            return self.calls.count(name)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]

        def record(request: Any, _context: grpc.ServicerContext) -> None:
            keepalive = method == "Free" and not request.request_ids and not request.rollback_request_ids
            with self._lock:
                self.calls.append("keepalive" if keepalive else method)

        return wrap_handler(continuation(details), record)


@pytest.fixture()
def engine_and_calls(tiny_llama_dir: Path) -> Iterator[tuple[Engine, CallCounter, Clock]]:
    hub = EventHub()
    servicer = KVCacheManagerServicer(ManagerBinding(hub), hub, max_subscribers=1)
    counter = CallCounter()
    running = start_server(ServerConfig(port=0, max_workers=4), [
        ServiceRegistration(SERVICE.grpc, servicer, pb_grpc.add_KVCacheManagerServicer_to_server)],
        interceptors=[counter])
    core = build_runner(RunnerConfig(model_dir=str(tiny_llama_dir), block_size=4, kv_cache_memory_bytes=1 << 20,
                                     warmup=False, dtype="float32", attention_backend="torch"))
    clock = Clock()
    kv = RemoteKVCache(f"127.0.0.1:{running.port}", owner_id="scheduler-1", lease_seconds=LEASE)
    engine = Engine(SchedulerConfig(owner_lease_seconds=LEASE), kv, SteppingRunner(core, clock), clock=clock)
    engine.start()
    try:
        yield engine, counter, clock
    finally:
        engine.stop()
        kv.close()
        servicer.close()
        running.stop(grace=0)
        core.pool.close()


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_steps_renew_the_lease_so_no_keepalive_runs_while_they_do(
        engine_and_calls: tuple[Engine, CallCounter, Clock]) -> None:
    engine, counter, clock = engine_and_calls
    spec = build_spec(engine, list(range(3, 23)), SamplingParams(ignore_eos=True), 12)
    chunks = list(OutputStream(engine, spec, None))
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert _wait_for(lambda: counter.count("Free") == 1)  # the finished request's blocks, once idle
    steps = engine.num_steps
    assert steps >= 12 and clock.now == 1000.0 + steps * INTERVAL  # every step made a keep-alive due
    assert counter.count("Initialize") == 1
    # One per step, and nothing else renewed the lease: with a renewal due after every step no step
    # was sent ahead (async scheduling's steps allocate nothing, so they wait for a renewing one).
    assert counter.count("AllocateSlots") == steps and engine.num_steps_ahead == 0
    assert counter.count("keepalive") == 0


def test_an_idle_engine_renews_once_per_interval(engine_and_calls: tuple[Engine, CallCounter, Clock]) -> None:
    _engine, counter, clock = engine_and_calls
    time.sleep(0.3)  # idle loop iterations with the clock standing still: nothing is due
    assert counter.calls == ["Initialize"]
    clock.now += INTERVAL - 0.001
    time.sleep(0.3)
    assert counter.calls == ["Initialize"]
    clock.now += 0.001
    assert _wait_for(lambda: counter.count("keepalive") == 1)
    time.sleep(0.3)  # the next one is due an interval later, not on the next loop iteration
    assert counter.calls == ["Initialize", "keepalive"]
    clock.now += INTERVAL
    assert _wait_for(lambda: counter.count("keepalive") == 2)
    assert counter.calls == ["Initialize", "keepalive", "keepalive"]
