"""What every worker shares, in the standard library only: the job and result files, RSS, the loop.

A worker is started as ``PYTHON bench/peerbench/worker_X.py JOB.json RESULT.json`` with its own
engine's venv, which has none of kvmesh's dependencies: so this module imports nothing but the
standard library. The loop (:func:`serve_job`) is the same for every engine, so every engine is
timed the same way: the wall time of one call that takes every prompt of a repeat at once and
returns every new token of it.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Engine(Protocol):
    """One loaded engine, as the loop needs it."""

    def generate(self, prompts: Sequence[Sequence[int]], output_len: int) -> list[list[int]]:
        """Greedy, EOS ignored, exactly ``output_len`` new tokens per prompt, in prompt order."""
        ...

    def resolved(self) -> dict[str, str]:
        """What the engine actually runs (dtype, backend, KV dtype, ...), as it reports it."""
        ...

    def close(self) -> None:
        """Frees processes and memory."""
        ...


def _children(pid: int, proc: str = "/proc") -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"{proc}/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _status_kib(pid: int, field: str, proc: str = "/proc", name: str = "status") -> int:
    try:
        with open(f"{proc}/{pid}/{name}") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_pids(root: int, proc: str = "/proc") -> list[int]:
    """``root`` and all its descendants (from ``/proc/PID/task/TID/children``), each once, in visiting order."""
    seen: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo.extend(_children(pid, proc))
    return seen


@dataclass(frozen=True)
class TreeMemory:
    """Memory of a process tree: the sum of each process's RSS, and of its PSS.

    RSS counts a page shared by N processes (torch's libraries, a shared KV pool) N times; PSS
    counts 1/N of it in each, so the PSS sum is what the tree really holds. Both are reported:
    RSS is what ``ps`` and other benchmarks show, PSS is the honest sum.
    """

    processes: int
    rss_kib: int
    pss_kib: int

    @property
    def rss_mib(self) -> float:
        """RSS sum in MiB."""
        return self.rss_kib / 1024

    @property
    def pss_mib(self) -> float:
        """PSS sum in MiB."""
        return self.pss_kib / 1024


def tree_memory(root: int, include_root: bool = True, proc: str = "/proc", pss: bool = True) -> TreeMemory:
    """The memory of ``root``'s process tree; without ``root`` itself when ``include_root`` is false
    (a worker that only drives a server it started counts the server's processes, not its own).

    ``pss=False`` skips PSS (reported as 0): ``smaps_rollup`` walks every page table of the process
    under its mmap lock, tens of milliseconds for a GiB-sized engine, where ``VmRSS`` is a counter.
    """
    pids = [p for p in tree_pids(root, proc) if os.path.exists(f"{proc}/{p}/status")]  # NOTE: gone ones don't count
    if not include_root:
        pids = [p for p in pids if p != root]
    rss = sum(_status_kib(p, "VmRSS:", proc) for p in pids)
    pss_kib = sum(_status_kib(p, "Pss:", proc, "smaps_rollup") for p in pids) if pss else 0
    return TreeMemory(len(pids), rss, pss_kib)


def tree_rss_mib(root: int) -> float:
    """Resident memory of ``root`` and all its descendants (vLLM's engine core, kvmesh's services)."""
    return tree_memory(root).rss_mib


class RssSampler:
    """The peak of :func:`tree_memory` of this process's tree: RSS sampled every ``interval``
    seconds, PSS every ``pss_interval``.

    PSS is sampled more sparsely because reading it disturbs the engine being measured: each read
    walks the page tables of every engine process while holding its mmap lock (an engine that
    frees a large tensor waits for it), and at 4 reads a second it took 10% of a 2-core machine's
    CPU samples in a batch-32 run (docs/benchmarks.md, "Session 30"). ``include_self``: whether
    this process counts (false for a worker whose engine is a server in child processes: its own
    client and driver are not the engine's memory).
    """

    def __init__(self, interval: float = 0.25, include_self: bool = True, pss_interval: float = 2.0) -> None:
        self.interval = interval
        self.pss_interval = pss_interval
        self.include_self = include_self
        self.peak = 0.0
        self.peak_pss = 0.0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def now(self, pss: bool = True) -> TreeMemory:
        """The tree's memory at this moment, PSS included only when ``pss`` (see :func:`tree_memory`)."""
        return tree_memory(os.getpid(), self.include_self, pss=pss)

    def _loop(self) -> None:
        last_pss = -float("inf")
        while not self._stop.is_set():
            started = time.monotonic()
            with_pss = started - last_pss >= self.pss_interval
            m = self.now(pss=with_pss)
            if with_pss:
                last_pss = started
                self.peak_pss = max(self.peak_pss, m.pss_mib)
            if m.rss_mib > self.peak:
                self.peak, self.peak_processes = m.rss_mib, m.processes
            self._stop.wait(self.interval)

    def start(self) -> RssSampler:
        """Starts sampling."""
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stops and returns the peak RSS sum (MiB)."""
        self._stop.set()
        self._thread.join()
        return self.peak


def load_job(path: str) -> dict[str, Any]:
    """The job file the orchestrator wrote."""
    with open(path) as f:
        job: dict[str, Any] = json.load(f)
    return job


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def _say(engine: str, message: str) -> None:
    print(f"[{engine}] {message}", file=sys.stderr, flush=True)


def serve_job(job: dict[str, Any], result_path: str, opener: Callable[[dict[str, Any]], Engine],
              versions: dict[str, str]) -> int:
    """Loads the engine, runs every workload (untimed warm-up, then timed repeats), writes the result.

    A failure is written into the result (``ok: false`` and the traceback) as well as raised to the
    exit code, so the orchestrator can report it and go on with the next engine.
    """
    name = job["engine"]
    result: dict[str, Any] = {"engine": name, "ok": False, "versions": versions, "python": platform.python_version(),
                              "workloads": {}}
    sampler = RssSampler(include_self=bool(job.get("count_worker", True))).start()
    engine: Engine | None = None
    try:
        t0 = time.perf_counter()
        engine = opener(job)
        result["startup_s"] = time.perf_counter() - t0
        result["resolved"] = engine.resolved()
        idle = sampler.now()
        result["rss_idle_mib"], result["pss_idle_mib"], result["processes"] = idle.rss_mib, idle.pss_mib, idle.processes
        _say(name, f"ready in {result['startup_s']:.1f} s: {result['resolved']}")
        for w in job["workloads"]:
            out_len = int(w["output_len"])
            engine.generate(w["warmup"], min(out_len, int(job.get("warmup_output_len", 4))))
            seconds: list[float] = []
            tokens: list[list[list[int]]] = []
            for rep, prompts in enumerate(w["repeats"]):
                start = time.perf_counter()
                ids = engine.generate(prompts, out_len)
                seconds.append(time.perf_counter() - start)
                bad = [len(t) for t in ids if len(t) != out_len]
                if len(ids) != len(prompts) or bad:
                    raise RuntimeError(f"{w['name']}: expected {len(prompts)} x {out_len} tokens, got lengths {bad}")
                tokens.append([list(map(int, t)) for t in ids])
                rate = len(prompts) * out_len / seconds[-1]
                _say(name, f"{w['name']} repeat {rep + 1}/{len(w['repeats'])}: {seconds[-1]:.2f} s, {rate:.1f} tok/s")
            result["workloads"][w["name"]] = {"seconds": seconds, "token_ids": tokens}
        result["ok"] = True
    except BaseException as exc:  # NOTE: any failure becomes a row saying why, not a lost run
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        _say(name, f"failed: {result['error']}")
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:  # NOTE: closing must not hide the figures already measured
                _say(name, f"close failed: {exc}")
        result["rss_peak_mib"] = sampler.stop()
        result["pss_peak_mib"], result["peak_processes"] = sampler.peak_pss, sampler.peak_processes
        result["rss_counts_worker"] = sampler.include_self
        _write(result_path, result)
    return 0 if result["ok"] else 1


def main(argv: Sequence[str], opener: Callable[[dict[str, Any]], Engine],
         versions: Callable[[], dict[str, str]]) -> int:
    """``worker.py JOB.json RESULT.json``."""
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    # NOTE: SIGTERM (the orchestrator stopping) unwinds through serve_job's finally: the engine's
    # own children (vLLM's engine core, kvmesh's services) are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return serve_job(load_job(argv[1]), argv[2], opener, versions())
