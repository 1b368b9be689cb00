"""``kvmesh up`` with a runner team smaller than the machine: the runner's compute thread on CPUs
of its own, every other service on the rest, restarts included (cpu_bind.split_for_suite)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.suite import Suite, SuiteConfig, runner_placement

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")


def _cpus(status_path: str) -> set[int]:
    for line in Path(status_path).read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
            return cpus
    raise AssertionError(f"no Cpus_allowed_list in {status_path}")


def _thread_cpus(pid: int) -> list[set[int]]:
    return [_cpus(f"/proc/{pid}/task/{tid}/status") for tid in os.listdir(f"/proc/{pid}/task")]


@two_cpus
def test_the_placement_is_read_from_the_runners_own_settings() -> None:
    last, rest = ALLOWED[-1], ALLOWED[:-1]
    assert runner_placement({"KVMESH_RUNNER_NUM_THREADS": "1"}) == ({"KVMESH_RUNNER_CPU_BIND": str(last)}, rest)
    assert runner_placement({"KVMESH_RUNNER_NUM_THREADS": "1", "KVMESH_RUNNER_CPU_BIND": "none"}) == ({}, ())
    assert runner_placement({"KVMESH_RUNNER_NUM_THREADS": "1", "KVMESH_RUNNER_CPU_BIND": "0"}) == ({}, ())
    assert runner_placement({}) == ({}, ())  # the default team takes every CPU: nothing to split


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    env = {"KVMESH_RUNNER_NUM_THREADS": "1", "KVMESH_RUNNER_WARMUP": "0",
           "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(1 << 20)}
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=False,
                          log_dir=str(tmp_path_factory.mktemp("suite-cpus-logs")), extra_env=env))
    yield s
    s.stop()


@two_cpus
def test_the_runners_compute_thread_has_the_last_cpu_and_the_other_services_the_rest(suite: Suite) -> None:
    last, rest = ALLOWED[-1], set(ALLOWED[:-1])
    runner = suite.services["model-runner"].proc.pid
    threads = _thread_cpus(runner)
    assert threads.count({last}) == 1  # the compute thread alone is bound
    assert _cpus(f"/proc/{runner}/status") == set(ALLOWED)  # its gRPC and other threads are not
    for name in ("scheduler", "kv-cache-manager"):
        pid = suite.services[name].proc.pid
        assert all(cpus == rest for cpus in _thread_cpus(pid)), name
    log = suite.services["model-runner"].log_path.read_text()
    assert f"compute thread: a team of 1 thread(s), bound to CPUs {last}" in log


@two_cpus
def test_a_restarted_service_keeps_its_cpus(suite: Suite) -> None:
    rest = set(ALLOWED[:-1])
    old = suite.services["kv-cache-manager"].proc.pid
    suite.restart("kv-cache-manager")
    new = suite.services["kv-cache-manager"].proc.pid
    assert new != old
    deadline = time.monotonic() + 5
    while not all(cpus == rest for cpus in _thread_cpus(new)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(cpus == rest for cpus in _thread_cpus(new))
