"""How well the paged pool uses memory, read from an in-process engine while a workload runs.

Two figures:

- **slot occupancy at peak**: when the running requests hold the most blocks, the share of their
  slots that hold real tokens::

      occupancy = sum(num_computed_tokens of running requests) / (distinct blocks held * block_size)

  Paged allocation wastes at most ``block_size - 1`` slots per request (its last, partial block);
  a contiguous cache reserving ``max_model_len`` slots per request would hold the same tokens in
  ``running * max_model_len`` slots (``contiguous_occupancy``).
- **concurrency the pool sustains**: the requests of this workload's largest size (prompt +
  output) that fit at once without preemption, ``usable_blocks // ceil(max_len / block_size)``,
  against a contiguous max-length reservation, ``num_blocks * block_size // max_model_len``. The
  peak number of running requests actually observed, and the preemptions, come with it.

NOTE: the sampler reads the engine's scheduler from another thread without a lock: it copies the
running list (atomic under the GIL) and tolerates a request changing mid-read. A sample is a
snapshot between or during steps; the peak over many samples is what is reported.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.inprocess import InProcessSuite


@dataclass(frozen=True)
class PoolSample:
    """One snapshot of the running requests."""

    running: int
    tokens: int
    blocks: int


@dataclass(frozen=True)
class MemoryReport:
    """Slot occupancy at the peak and the pool's concurrency, paged vs contiguous."""

    block_size: int
    num_blocks: int
    usable_blocks: int
    max_model_len: int
    peak_blocks: int
    peak_tokens: int
    peak_running_at_peak_blocks: int
    occupancy: float
    contiguous_occupancy: float
    max_running_observed: int
    preemptions: int
    paged_capacity: int
    contiguous_capacity: int
    workload_max_len: int


def take_sample(suite: InProcessSuite) -> PoolSample:
    """A snapshot of the engine's running requests (see the NOTE in the module docstring)."""
    running = list(suite.engine.scheduler.running)
    blocks: set[int] = set()
    tokens = 0
    for req in running:
        blocks.update(list(req.block_ids))
        tokens += req.num_computed_tokens
    return PoolSample(len(running), tokens, len(blocks))


class PoolSampler:
    """Samples an engine every ``interval`` seconds in a thread, between :meth:`start` and :meth:`stop`."""

    def __init__(self, suite: InProcessSuite, interval: float = 0.002) -> None:
        self.suite = suite
        self.interval = interval
        self.samples: list[PoolSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-pool-sampler", daemon=True)
        self._preemptions_before = 0

    def start(self) -> PoolSampler:
        """Starts sampling."""
        self._preemptions_before = self.suite.engine.scheduler.num_preemptions
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stops sampling; returns the preemptions that happened meanwhile."""
        self._stop.set()
        self._thread.join()
        return self.suite.engine.scheduler.num_preemptions - self._preemptions_before

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(take_sample(self.suite))


def memory_report(
    samples: list[PoolSample],
    preemptions: int,
    block_size: int,
    num_blocks: int,
    usable_blocks: int,
    max_model_len: int,
    workload_max_len: int,
) -> MemoryReport:
    """The figures of the module docstring from samples and the pool's geometry.

    Args:
        num_blocks: blocks in the pool (what a contiguous cache of the same memory would hold).
        usable_blocks: blocks requests can hold (the pool minus the null block).
        workload_max_len: the longest prompt + output of the workload.
    """
    peak = max(samples, key=lambda s: (s.blocks, s.tokens), default=PoolSample(0, 0, 0))
    slots = peak.blocks * block_size
    return MemoryReport(
        block_size=block_size,
        num_blocks=num_blocks,
        usable_blocks=usable_blocks,
        max_model_len=max_model_len,
        peak_blocks=peak.blocks,
        peak_tokens=peak.tokens,
        peak_running_at_peak_blocks=peak.running,
        occupancy=peak.tokens / slots if slots else 0.0,
        contiguous_occupancy=peak.tokens / (peak.running * max_model_len) if peak.running else 0.0,
        max_running_observed=max((s.running for s in samples), default=0),
        preemptions=preemptions,
        paged_capacity=usable_blocks // math.ceil(workload_max_len / block_size) if workload_max_len else 0,
        contiguous_capacity=num_blocks * block_size // max_model_len,
        workload_max_len=workload_max_len,
    )
