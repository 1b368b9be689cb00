"""The whole engine in one process: the same scheduler, kv-cache-manager and runner cores, no gRPC.

Used to measure what the microservice split costs (``bench/``), and by tests that need the real
cores together without processes. The peers are reached only through their in-process clients
(built from each peer's own config), so the scheduler never imports another service's core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.kv_cache_manager.client import InProcessKVCache
from services.model_runner.client import InProcessRunner
from services.model_runner.config import RunnerConfig
from services.offload_store.client import InProcessOffload
from services.offload_store.config import OffloadConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine
from services.scheduler.tokenizer import Tokenizer


@dataclass
class InProcessSuite:
    """An engine wired to in-process cores (through their peers' in-process clients), plus the tokenizer."""

    engine: Engine
    kv: InProcessKVCache
    runner_client: InProcessRunner
    tokenizer: Tokenizer | None
    store: InProcessOffload | None = None  # the offload-store in this process, when configured

    @property
    def manager(self) -> Any:
        """The kv-cache-manager core (bound by the engine's start), for tests and benchmarks to inspect."""
        return self.kv.manager

    @property
    def runner(self) -> Any:
        """The model-runner core, for tests and benchmarks to inspect."""
        return self.runner_client.core

    def close(self) -> None:
        """Stops the engine, closes the store and releases the pool file."""
        self.engine.stop()
        self.runner_client.close()
        if self.store is not None:
            self.store.close()
        self.runner_client.core.pool.close()


def build_inprocess(runner_config: RunnerConfig, scheduler_config: SchedulerConfig | None = None,
                    with_tokenizer: bool = True, offload_config: OffloadConfig | None = None) -> InProcessSuite:
    """Builds and starts an in-process engine for ``runner_config.model_dir``.

    With ``offload_config`` an in-process offload-store maps the runner's pool through its
    shared-memory handle, exactly as the service does.
    """
    sched_config = scheduler_config or SchedulerConfig()
    runner = InProcessRunner.from_config(runner_config)
    store = InProcessOffload(offload_config) if offload_config is not None else None
    kv = InProcessKVCache()  # created by the engine's bind, from the runner's geometry
    engine = Engine(sched_config, kv, runner, store)
    tokenizer = Tokenizer(runner_config.model_dir) if with_tokenizer else None
    return InProcessSuite(engine.start(), kv, runner, tokenizer, store)
