"""The whole engine in one process: the same scheduler, kv-cache-manager and runner cores, no gRPC.

Used to measure what the microservice split costs (``bench/``), and by tests that need the real
cores together without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.kv_cache_manager.manager import KVCacheManager
from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner
from services.model_runner.runner import ModelRunnerCore
from services.scheduler.backends import InProcessKVCache, InProcessRunner
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine
from services.scheduler.tokenizer import Tokenizer
from shared.config import CacheConfig


@dataclass
class InProcessSuite:
    """An engine wired to in-process cores, plus the tokenizer."""

    engine: Engine
    manager: KVCacheManager
    runner: ModelRunnerCore
    tokenizer: Tokenizer | None

    def close(self) -> None:
        """Stops the engine and releases the pool file."""
        self.engine.stop()
        self.runner.pool.close()


def build_inprocess(runner_config: RunnerConfig, scheduler_config: SchedulerConfig | None = None,
                    deployment_key: str = "kvmesh-dev", with_tokenizer: bool = True) -> InProcessSuite:
    """Builds and starts an in-process engine for ``runner_config.model_dir``."""
    runner = build_runner(runner_config)
    info = runner.model_info()
    manager = KVCacheManager(CacheConfig(block_size=info.block_size, num_blocks=info.num_blocks,
                                         max_model_len=info.max_model_len, model_id=info.model_id,
                                         deployment_key=deployment_key))
    engine = Engine(scheduler_config or SchedulerConfig(), InProcessKVCache(manager), InProcessRunner(runner))
    tokenizer = Tokenizer(runner_config.model_dir) if with_tokenizer else None
    return InProcessSuite(engine.start(), manager, runner, tokenizer)
