"""Which CPUs the model-runner's compute threads are bound to (``RunnerConfig.cpu_bind``).

Why: a decode step is one long run of kernels on the runner's compute thread(s). Left to the OS,
a compute thread is moved or preempted whenever another process of the suite wakes up (the
scheduler, a gRPC thread, the client), and each move leaves its caches behind. vLLM's CPU worker
binds its OpenMP threads to cores for the same reason (``VLLM_CPU_OMP_THREADS_BIND``, ``auto`` by
default). The rule here (docs/model_runner.md, "The compute thread and its CPUs"):

- ``auto``: bind one thread to each CPU this process may use (its affinity mask) when the team
  takes all of them (the factory passes the team's size: ``num_threads``, else torch's count, one
  per physical core, so a machine with SMT siblings is left unbound): nothing else is displaced.
  With fewer threads than CPUs the runner alone cannot know which CPUs are free of other runners
  (two replicas on one machine would both pick the same ones), so it binds nothing; a launcher
  that knows, ``kvmesh up``, gives it an explicit list and keeps its other services off those CPUs
  (:func:`split_for_suite`);
- ``none``: never bind;
- a list (``"3"``, ``"2,3"``, ``"0-3"``): member ``i`` of the team on the ``i``-th CPU listed; the
  list's length is the team's size, and ``num_threads``, where set, must equal it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

AUTO, NONE = "auto", "none"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``, in the order written.

    Raises:
        ValueError: not a list of CPU numbers and ranges, a CPU listed twice, or an empty list.
    """
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"cpu_bind must be auto, none or a CPU list such as 0-3 or 2,3; got {text!r}")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"cpu_bind: the range {part.strip()!r} runs backwards")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_bind lists a CPU twice: {text!r}")
    return tuple(cpus)


def check_setting(setting: str, num_threads: int) -> None:
    """Validates ``RunnerConfig.cpu_bind`` against ``num_threads`` (no look at this machine).

    Raises:
        ValueError: not ``auto``, ``none`` or a CPU list, or a list whose length is not ``num_threads``.
    """
    if setting in (AUTO, NONE):
        return
    cpus = parse_cpu_list(setting)
    if num_threads and num_threads != len(cpus):
        raise ValueError(f"cpu_bind lists {len(cpus)} CPUs for a team of num_threads={num_threads}: "
                         f"one thread is bound to each CPU listed")


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask, which a cgroup cpuset narrows), sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


def resolve(setting: str, num_threads: int, allowed: Sequence[int]) -> tuple[int, ...]:
    """The CPU of each compute thread, member 0 (the compute thread itself) first; ``()``: unbound.

    Raises:
        ValueError: an invalid setting (:func:`check_setting`), or a listed CPU outside ``allowed``.
    """
    check_setting(setting, num_threads)
    if setting == NONE:
        return ()
    if setting == AUTO:
        return tuple(allowed) if num_threads in (0, len(allowed)) else ()
    cpus = parse_cpu_list(setting)
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"cpu_bind lists CPUs {outside} that this process may not run on (allowed: "
                         f"{format_cpu_list(allowed)})")
    return cpus


def split_for_suite(setting: str, num_threads: int, allowed: Sequence[int]
                    ) -> tuple[str, tuple[int, ...]] | None:
    """``kvmesh up``'s placement: the runner's ``cpu_bind`` and the CPUs of every other service,
    or None to leave all of them to the OS.

    Only under ``auto`` with a team smaller than the CPUs (``0 < num_threads < len(allowed)``):
    the runner takes the last ``num_threads`` CPUs and the other services the rest, so no service
    of the suite preempts a compute thread. An explicit list or ``none`` is the user's placement.
    """
    if setting != AUTO or not 0 < num_threads < len(allowed):
        return None
    ordered = sorted(allowed)
    return format_cpu_list(ordered[-num_threads:]), tuple(ordered[:-num_threads])


def format_cpu_list(cpus: Sequence[int]) -> str:
    """``(2, 3)`` -> ``"2,3"``: a list :func:`parse_cpu_list` reads back in the same order."""
    return ",".join(str(c) for c in cpus)
