"""The one OS thread every step of a runner runs on, with its OpenMP team sized and bound.

Why one thread: OpenMP's thread count is a per-thread setting and each thread that opens a
parallel region gets its own team. Steps used to run on whichever thread took them (a gRPC
handler thread of the servicer, the engine's thread or its step worker in-process): there the
native kernels ran with one thread per CPU whatever ``num_threads`` said (``torch.set_num_threads``
at start-up sets the main thread's count only), each handler thread grew its own team, and the OS
moved them between CPUs. On this thread the count is set once, its team is the only team, and with
``cpu_bind`` each member stays on its CPU (cpu_bind.py; docs/model_runner.md, "The compute thread
and its CPUs").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from services.model_runner.cpu_bind import format_cpu_list
from services.model_runner.native import NativeKernels

log = logging.getLogger(__name__)

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time, in submission order, on one thread prepared at its start.

    Args:
        num_threads: the team's size (the thread's OpenMP and torch intra-op count); 0 keeps the
            default (one per CPU), or with ``cpus`` one per CPU listed.
        cpus: member ``i`` of the team bound to ``cpus[i]`` (``cpu_bind.resolve``); empty: unbound.
        kernels: the native kernels, which bind the team's other members (without them only the
            compute thread itself is bound).
        device: a CUDA device becomes the thread's current device (the one its kernels launch on).
    """

    def __init__(self, num_threads: int, cpus: Sequence[int] = (), kernels: NativeKernels | None = None,
                 device: torch.device | None = None) -> None:
        self.team = num_threads or len(cpus)
        self.cpus = tuple(cpus)
        self._device = device
        self.bound: tuple[int, ...] = ()  # the CPUs bound, once the thread has started
        self._kernels = kernels
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-compute",
                                        initializer=self._prepare)
        self._pool.submit(lambda: None).result()  # started and prepared before any step

    def _prepare(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        if self.team:
            torch.set_num_threads(self.team)  # this thread's OpenMP count (the native kernels' too) and torch's
        if not self.cpus:
            return
        bind_team = self._kernels.bind_team if self._kernels is not None else None
        cpus = self.cpus if bind_team is not None else self.cpus[:1]  # without it: this thread alone
        listed = torch.tensor(cpus, dtype=torch.int64)  # alive through the call that reads it
        try:
            if bind_team is None:
                os.sched_setaffinity(0, set(cpus))  # pid 0: this thread
            elif bind_team(listed.data_ptr(), len(cpus)) != 0:
                raise OSError("the OpenMP team could not be bound")
        except OSError as exc:
            log.warning("compute thread: binding to CPUs %s failed (%s); left to the OS",
                        format_cpu_list(self.cpus), exc)
            return
        self.bound = cpus

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Queues ``fn(*args)``; it runs after everything submitted before it."""
        return self._pool.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the compute thread, waited for; raises what it raised."""
        return self._pool.submit(fn, *args).result()

    def describe(self) -> str:
        """One line for the start-up log: the team and where it runs."""
        where = f"bound to CPUs {format_cpu_list(self.bound)}" if self.bound else "not bound to CPUs"
        return f"compute thread: a team of {self.team or os.cpu_count()} thread(s), {where}"

    def close(self) -> None:
        """Ends the thread after what it runs."""
        self._pool.shutdown(wait=True)
