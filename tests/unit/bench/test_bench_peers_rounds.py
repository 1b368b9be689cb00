"""``bench/peers.py --interleave``: repeats as rounds of fresh engine processes, merged per engine.

The orchestrator is what is under test: real worker subprocesses (``wire.serve_job``) run a
stand-in engine whose outputs are a function of the prompt, so every merged token and the order
of the rounds can be checked exactly; the engines themselves are the peers tests' business.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peerbench import engines as eng
from bench.peerbench.orchestrate import RunConfig, load_result, merge_rounds, round_prompts, run_rounds
from bench.peerbench.render import render
from bench.peerbench.table import Report, build_report
from bench.peerbench.workloads import Workload, build_prompts

WORKER = '''
import sys
from bench.peerbench import wire

class Echo:
    """Each output token = the prompt's first id + its index; the process id shows which start ran."""
    def __init__(self, job):
        import os
        self.pid = os.getpid()
    def generate(self, prompts, output_len):
        return [[p[0] + i for i in range(output_len)] for p in prompts]
    def resolved(self):
        return {"dtype": "float32", "backend": "echo", "pid": str(self.pid)}
    def close(self):
        pass

sys.exit(wire.main(sys.argv, Echo, lambda: {"echo": "1"}))
'''


@dataclass(frozen=True)
class _ScriptSpec(eng.EngineSpec):
    """An engine row whose worker is a script of the test's (the real rows' workers need their venvs)."""

    script: str = ""

    @property
    def worker(self) -> Path:
        return Path(self.script)


def _prompts(repeats: int) -> list[Any]:
    return [build_prompts(Workload("single", 1, 3, 2), 500, repeats, 0, 0),
            build_prompts(Workload("batch2", 2, 3, 2), 500, repeats, 0, 1)]


def test_round_r_keeps_the_warmup_and_only_repeat_r() -> None:
    prompts = _prompts(3)
    for r in range(3):
        got = round_prompts(prompts, r)
        assert [g.workload for g in got] == [p.workload for p in prompts]
        assert [g.warmup for g in got] == [p.warmup for p in prompts]
        assert [g.repeats for g in got] == [(p.repeats[r],) for p in prompts]


def _round(seconds: float, tokens: list[list[int]], ok: bool = True, **extra: Any) -> dict[str, Any]:
    res = {"engine": "e", "ok": ok, "startup_s": 10.0 + seconds, "rss_idle_mib": 100.0 + seconds,
           "rss_peak_mib": 150.0 + 10 * seconds, "pss_peak_mib": 140.0, "peak_processes": 3, "wall_s": 20.0,
           "resolved": {"dtype": "float32"}, "workloads": {"w": {"seconds": [seconds], "token_ids": [tokens]}}}
    res.update(extra)
    return res


def test_merge_puts_the_rounds_in_order_and_keeps_the_largest_peak() -> None:
    merged = merge_rounds([_round(3.0, [[1]]), _round(1.0, [[2]]), _round(2.0, [[3]])])
    assert merged["workloads"] == {"w": {"seconds": [3.0, 1.0, 2.0], "token_ids": [[[1]], [[2]], [[3]]]}}
    assert (merged["ok"], merged["rounds"], merged["startup_s"], merged["rss_idle_mib"]) == (True, 3, 13.0, 103.0)
    assert merged["startup_s_rounds"] == [13.0, 11.0, 12.0]
    assert (merged["rss_peak_mib"], merged["pss_peak_mib"], merged["peak_processes"]) == (180.0, 140.0, 3)
    assert merged["wall_s"] == 60.0 and "error" not in merged


def test_a_failed_round_fails_the_engine_and_says_which() -> None:
    bad = _round(1.0, [[2]], ok=False, error="RuntimeError: boom", traceback="...")
    bad["workloads"] = {}
    merged = merge_rounds([_round(3.0, [[1]]), bad, _round(2.0, [[3]])])
    assert (merged["ok"], merged["error"]) == (False, "round 2: RuntimeError: boom")
    assert merged["workloads"]["w"]["seconds"] == [3.0, 2.0] and "traceback" not in merged


def test_rounds_start_every_engine_afresh_and_merge_what_they_measured(tmp_path: Path) -> None:
    script = tmp_path / "worker_echo.py"
    script.write_text(WORKER)
    specs = [_ScriptSpec(name, name.upper(), "openai", script=str(script)) for name in ("a", "b")]
    cfg = RunConfig(model_dir=tmp_path, work_dir=tmp_path / "work", pythons={"openai": sys.executable})
    prompts = _prompts(3)
    results = run_rounds(specs, cfg, prompts)
    for spec in specs:
        res = results[spec.name]
        assert (res["ok"], res["rounds"], len(res["startup_s_rounds"])) == (True, 3, 3)
        for p in prompts:
            got = res["workloads"][p.workload.name]
            assert len(got["seconds"]) == 3 and all(s > 0 for s in got["seconds"])
            # repeat r's outputs come from round r's prompts, in round order
            n = p.workload.output_len
            assert got["token_ids"] == [[[q[0] + i for i in range(n)] for q in rep] for rep in p.repeats]
        # the merged result is where --report-only looks, and it is the same
        assert load_result(spec, cfg.work_dir) == json.loads(json.dumps(res))
    # each round was its own worker process (the job file of the last round holds one repeat)
    job = json.loads((cfg.work_dir / "a.job.json").read_text())
    assert [len(w["repeats"]) for w in job["workloads"]] == [1, 1]
    assert job["workloads"][0]["repeats"][0] == [list(x) for x in prompts[0].repeats[2]]


def _one_engine_report(meta: dict[str, Any]) -> Report:
    """A report of one kvmesh engine's one-repeat single-stream result, with the given meta."""
    w = Workload("single", 1, 4, 4)
    res = {"ok": True, "resolved": {"dtype": "float32", "backend": "b"}, "startup_s": 1.0, "rss_idle_mib": 1.0,
           "rss_peak_mib": 1.0, "versions": {}, "workloads": {"single": {"seconds": [1.0], "token_ids": [[[1] * 4]]}}}
    results = {"kvmesh-suite-fp32": res}
    return build_report([w], list(results), {"kvmesh-suite-fp32": "K"}, results, eng.reference(results),
                        eng.BASELINE, eng.FP32_BASELINE, {"command": "c", "threads": 1, "repeats": 1, **meta})


def test_the_report_says_the_engines_ran_in_rounds() -> None:
    report = _one_engine_report({"interleave": True})
    text = render(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)
    assert "Engines ran in rounds: in each round every engine in turn, started afresh" in text
    assert "one after the other" not in text
    report.meta["interleave"] = False
    assert "Engines ran one after the other, each in its own process and venv." in render(
        report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)


def test_the_report_says_other_processes_competed_only_when_the_load_passed_the_core_count() -> None:
    machine: dict[str, Any] = {"cpu_count": 2, "load_start": (0.92, 0.97, 0.99), "load_end": (1.10, 1.14, 1.19)}
    report = _one_engine_report({"machine": machine})
    text = render(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)
    assert "0.92 / 0.97 / 0.99 at the start, 1.10 / 1.14 / 1.19 at the end (within the core count)." in text
    machine["load_end"] = (2.40, 1.50, 1.20)
    text = render(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)
    assert "at the end (above the core count: other processes competed for the cores)." in text
