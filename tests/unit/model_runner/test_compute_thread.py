"""``ComputeThread``: every step on one thread, its OpenMP team sized and bound as configured."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from services.model_runner.compute_thread import ComputeThread
from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner
from services.model_runner.native import NativeKernels, load_kernels

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    k = load_kernels()
    if k is None:
        pytest.skip("the native kernels do not build here")
    return k


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


def test_the_team_size_is_the_compute_threads_own_whatever_a_fresh_thread_gets(kernels: NativeKernels) -> None:
    # A thread that never set its count opens teams of the process default (OMP_NUM_THREADS, else
    # one per CPU): where steps used to run. The compute thread's count is the configured one.
    for team in (1, 2):
        compute = ComputeThread(team, (), kernels)
        try:
            assert compute.run(kernels.team_size) == team
            assert compute.run(threading.current_thread).name.startswith("kvmesh-compute")
        finally:
            compute.close()


def test_every_call_runs_on_the_one_thread_in_submission_order() -> None:
    compute = ComputeThread(0)
    try:
        seen: list[tuple[int, int]] = []
        futures = [compute.submit(lambda i=i: seen.append((i, threading.get_native_id()))) for i in range(20)]
        for f in futures:
            f.result()
        assert [i for i, _ in seen] == list(range(20))
        assert len({tid for _, tid in seen}) == 1
        with pytest.raises(ZeroDivisionError):
            compute.run(lambda: 1 / 0)
        assert compute.run(lambda: 7) == 7  # an exception does not end the thread
        assert compute.bound == () and "not bound to CPUs" in compute.describe()
    finally:
        compute.close()


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_each_member_of_the_team_stays_on_its_cpu(kernels: NativeKernels) -> None:
    first, last = ALLOWED[0], ALLOWED[-1]
    before = set(os.listdir("/proc/self/task"))
    compute = ComputeThread(2, (last, first), kernels)
    try:
        tid = compute.run(threading.get_native_id)
        assert _affinity(tid) == {last}  # member 0: the compute thread itself
        assert compute.bound == (last, first)
        assert compute.describe() == f"compute thread: a team of 2 thread(s), bound to CPUs {last},{first}"
        compute.run(kernels.team_size)  # a region of the team: its member 1 is the same thread
        new = {int(t) for t in set(os.listdir("/proc/self/task")) - before} - {tid}
        assert {t for t in new if _affinity(t) == {first}}, "member 1 of the team is not on its CPU"
    finally:
        compute.close()


def test_a_binding_the_os_refuses_leaves_the_thread_working_and_unbound(
        kernels: NativeKernels, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="services.model_runner.compute_thread"):
        compute = ComputeThread(1, (4095,), kernels)  # no such CPU here
    try:
        assert compute.bound == ()
        assert "binding to CPUs 4095 failed" in caplog.text
        assert compute.run(lambda: 3) == 3
        assert set(ALLOWED) <= _affinity(compute.run(threading.get_native_id))
    finally:
        compute.close()


def test_the_factory_gives_the_runner_a_compute_thread_of_num_threads(tiny_llama_dir: Path,
                                                                      kernels: NativeKernels) -> None:
    core = build_runner(RunnerConfig(model_dir=str(tiny_llama_dir), num_threads=1, cpu_bind="none",
                                     kv_cache_memory_bytes=1 << 20))
    assert core.compute is not None
    assert core.compute.run(kernels.team_size) == 1
    assert core.compute.bound == ()
    # the default team: torch's count (one per physical core), set on the compute thread itself,
    # whose own OpenMP default would be one per logical CPU
    core = build_runner(RunnerConfig(model_dir=str(tiny_llama_dir), kv_cache_memory_bytes=1 << 20))
    assert core.compute is not None
    assert core.compute.team == torch.get_num_threads()
    assert core.compute.run(kernels.team_size) == torch.get_num_threads()
    assert core.compute.bound == (ALLOWED if torch.get_num_threads() == len(ALLOWED) else ())
    if len(ALLOWED) >= 2:
        core = build_runner(RunnerConfig(model_dir=str(tiny_llama_dir), num_threads=1, cpu_bind=str(ALLOWED[-1]),
                                         kv_cache_memory_bytes=1 << 20))
        assert core.compute is not None and core.compute.bound == (ALLOWED[-1],)
        assert _affinity(core.compute.run(threading.get_native_id)) == {ALLOWED[-1]}
