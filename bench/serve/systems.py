"""The four systems of ``bench compare``, each behind one small interface: warm up, run a workload, close.

    suite       kvmesh as processes (``services.suite.Suite``), driven over gRPC by the serve driver
    inprocess   the same engine in this process (``build_inprocess``), driven through ``OutputStream``
    hf-static   transformers ``generate()``, batched, static cache
    hf-cb       transformers continuous batching (``generate_batch``'s manager), paged cache

All receive the same prompts and output length and decode greedily with EOS ignored. A system is
opened once and measured several times (repeats interleave the systems, so slow drift of a noisy
machine spreads over all of them instead of biasing one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bench.serve.datasets import Conversation, Turn
from bench.serve.driver import BenchRun, Driver, DriverConfig
from bench.serve.metrics import Summary, summarize
from bench.serve.peers import ContinuousBatchingPeer, PeerRun, StaticGeneratePeer
from bench.serve.transports import GrpcTransport, InProcessTransport, Transport

SYSTEMS = ("suite", "inprocess", "hf-static", "hf-cb")
LABELS = {
    "suite": "kvmesh gRPC suite (4 processes)",
    "inprocess": "kvmesh in-process engine",
    "hf-static": "transformers generate(), static cache",
    "hf-cb": "transformers generate_batch(), paged",
}


@dataclass(frozen=True)
class Measurement:
    """One run of one system: output tokens/s, the tokens of each prompt, and (kvmesh only) the run."""

    tokens_per_second: float
    token_ids: tuple[tuple[int, ...], ...]
    run: BenchRun | None = None
    summary: Summary | None = None


class System(Protocol):
    """What the comparison needs of a system."""

    def measure(self, prompts: Sequence[Sequence[int]], output_len: int) -> Measurement:
        """Runs every prompt once (all offered at once) and measures output tokens/s."""
        ...

    def close(self) -> None:
        """Releases processes and memory."""
        ...


def conversations(prompts: Sequence[Sequence[int]], output_len: int, salt: str = "") -> list[Conversation]:
    """The prompts as one-turn conversations for the driver."""
    return [Conversation(i, (Turn(tuple(p), output_len),), cache_salt=salt) for i, p in enumerate(prompts)]


class DrivenSystem:
    """A kvmesh system measured by the serve driver at max concurrency = the number of prompts."""

    def __init__(self, transport: Transport, progress: bool, closer: Any, inprocess: Any = None) -> None:
        self.transport = transport
        self.progress = progress
        self._closer = closer
        self.inprocess = inprocess  # the InProcessSuite, whose state the memory figures read

    def drive(self, convs: Sequence[Conversation], max_concurrency: int | None = None) -> BenchRun:
        """Runs conversations through the driver, all offered at once."""
        config = DriverConfig(
            request_rate=math.inf, max_concurrency=max_concurrency or len(convs), progress=self.progress
        )
        return Driver(self.transport, config).run(convs)

    def measure(self, prompts: Sequence[Sequence[int]], output_len: int) -> Measurement:
        """Output tokens/s as the serving benchmark reports it (tokens / first send to last token)."""
        run = self.drive(conversations(prompts, output_len))
        failed = [r for r in run.records if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
        summary = summarize(run.records, run.duration)
        tokens = tuple(tuple(r.output_token_ids) for r in run.records)
        return Measurement(summary.output_throughput, tokens, run, summary)

    def close(self) -> None:
        """Stops the suite or engine."""
        self._closer()


class PeerSystem:
    """A transformers peer."""

    def __init__(self, peer: StaticGeneratePeer | ContinuousBatchingPeer) -> None:
        self.peer = peer

    def measure(self, prompts: Sequence[Sequence[int]], output_len: int) -> Measurement:
        """Output tokens / wall seconds of the peer's call."""
        result: PeerRun = self.peer.run(prompts, output_len)
        return Measurement(result.tokens_per_second, result.token_ids)

    def close(self) -> None:
        """Drops the model."""
        del self.peer


def open_system(name: str, model_dir: str, kv_cache_memory_bytes: int, progress: bool,
                attention_backend: str = "auto") -> DrivenSystem | PeerSystem:
    """Starts one system (loads its model; the suite starts its processes)."""
    if name == "suite":
        from services.suite import Suite, SuiteConfig

        suite = Suite(
            SuiteConfig(
                model_dir=model_dir,
                scheduler_port=0,
                with_offload=False,
                extra_env={
                    "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(kv_cache_memory_bytes),
                    "KVMESH_RUNNER_ATTENTION_BACKEND": attention_backend,
                },
            )
        )
        grpc_transport = GrpcTransport(suite.address)

        def close_suite() -> None:
            grpc_transport.close()
            suite.stop()

        return DrivenSystem(grpc_transport, progress, close_suite)
    if name == "inprocess":
        engine = open_inprocess(model_dir, kv_cache_memory_bytes, attention_backend)
        return DrivenSystem(InProcessTransport(engine), progress, engine.close, inprocess=engine)
    if name == "hf-static":
        return PeerSystem(StaticGeneratePeer(model_dir))
    if name == "hf-cb":
        return PeerSystem(ContinuousBatchingPeer(model_dir))
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def open_inprocess(model_dir: str, kv_cache_memory_bytes: int, attention_backend: str = "auto") -> Any:
    """An in-process engine with the suite's defaults (same pool size, same scheduler limits)."""
    from services.model_runner.config import RunnerConfig
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.inprocess import build_inprocess

    return build_inprocess(
        RunnerConfig(model_dir=model_dir, kv_cache_memory_bytes=kv_cache_memory_bytes,
                     attention_backend=attention_backend),
        SchedulerConfig(),
        with_tokenizer=False,
    )
