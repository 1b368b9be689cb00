"""One engine after the other, each in its own subprocess with its own venv's python.

Each worker gets a job file (the prompts of every workload, its settings, the thread count) and
writes a result file (``wire.serve_job``); its output goes to a log in the work folder, and its
own progress lines are echoed. A worker that fails, times out or whose venv is missing becomes a
row saying so; the run goes on with the next engine.

Rounds (``--interleave``): repeat ``r`` of every workload runs as round ``r``, every engine started
afresh in turn (``round_prompts``), and each engine's rounds are merged into one result
(``merge_rounds``) as if its repeats had run in one process. Why: this machine's speed drifts over
minutes (another tenant's load, the clock): a peer measured at 192 tok/s in one run made 149 a
quarter of an hour later, so an engine whose repeats all ran in a slow stretch lost its ratio by
as much as the target's margin. In rounds each engine's median spreads over the whole run's
stretches alike; the price is one start-up per engine and round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peerbench.engines import EngineSpec
from bench.peerbench.workloads import WARMUP_OUTPUT_LEN, WorkloadPrompts

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunConfig:
    """Where things are and how to run them."""

    model_dir: Path
    work_dir: Path
    pythons: dict[str, str]  # kind -> interpreter
    threads: int = 1
    engine_timeout_s: float = 2400.0
    vllm_kv_space_gib: int = 2
    vllm_enforce_eager: bool = True
    kv_cache_memory_bytes: int = 512 << 20
    ggufs: tuple[tuple[str, str], ...] = ()  # "f32" / "q4_1" -> path


def _env(spec: EngineSpec, cfg: RunConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KVMESH_RUNNER_")}
    if spec.kind == "vllm":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if cfg.threads == 1 else f"0-{cfg.threads - 1}"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm_kv_space_gib)
    else:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    if spec.kind in ("kvmesh", "openai"):
        env["PYTHONPATH"] = str(ROOT)
    return env


def job_for(spec: EngineSpec, cfg: RunConfig, prompts: Sequence[WorkloadPrompts]) -> dict[str, Any]:
    """The job file's content for one engine."""
    settings = dict(spec.settings)
    if spec.kind == "llamacpp":
        settings["gguf"] = dict(cfg.ggufs)[settings["gguf"]]
    if spec.kind == "vllm":
        settings["enforce_eager"] = cfg.vllm_enforce_eager
    if spec.kind == "kvmesh" or settings.get("server") == "kvmesh":
        settings["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    if settings.get("server") == "vllm":  # NOTE: the driver runs in kvmesh's venv, the server in vLLM's
        settings.update(vllm_python=cfg.pythons.get("vllm", ""), enforce_eager=cfg.vllm_enforce_eager,
                        kv_space_gib=cfg.vllm_kv_space_gib)
    return {
        "engine": spec.name,
        "count_worker": spec.count_worker,
        "model_dir": str(cfg.model_dir),
        "threads": cfg.threads,
        "settings": settings,
        "log_dir": str(cfg.work_dir / "logs"),
        "warmup_output_len": WARMUP_OUTPUT_LEN,
        "workloads": [{"name": p.workload.name, "output_len": p.workload.output_len,
                       "warmup": [list(x) for x in p.warmup], "repeats": [[list(x) for x in rep] for rep in p.repeats]}
                      for p in prompts],
    }


def _failed(spec: EngineSpec, why: str) -> dict[str, Any]:
    print(f"bench peers: {spec.name}: {why}", file=sys.stderr, flush=True)
    return {"engine": spec.name, "ok": False, "error": why, "workloads": {}}


def run_engine(spec: EngineSpec, cfg: RunConfig, prompts: Sequence[WorkloadPrompts]) -> dict[str, Any]:
    """Runs one engine's worker to the end; its result dict (``ok: false`` and why, on failure)."""
    python = cfg.pythons.get(spec.kind, "")
    if not python or not Path(python).exists():
        return _failed(spec, f"no python for {spec.kind} at {python!r} (create the venvs with `make peers`)")
    try:
        job = job_for(spec, cfg, prompts)
    except (KeyError, FileNotFoundError, RuntimeError) as exc:
        return _failed(spec, f"cannot prepare the job: {exc}")
    logs = cfg.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    job_path, result_path = cfg.work_dir / f"{spec.name}.job.json", cfg.work_dir / f"{spec.name}.result.json"
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    print(f"bench peers: starting {spec.name} ({spec.label}) with {python} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    with open(logs / f"{spec.name}.log", "w") as log:
        proc = subprocess.Popen([python, str(spec.worker), str(job_path), str(result_path)], cwd=ROOT,
                                env=_env(spec, cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        watchdog = threading.Timer(cfg.engine_timeout_s, proc.terminate)  # NOTE: a hung worker prints nothing
        watchdog.start()
        try:
            for line in proc.stdout:  # NOTE: the worker's own lines start with "[name]"; the rest only in the log
                log.write(line)
                if line.startswith(f"[{spec.name}]"):
                    print(f"bench peers: {line.rstrip()}", file=sys.stderr, flush=True)
            rc = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:  # NOTE: interrupted here: the worker stops its engine (SIGTERM), then goes
                proc.terminate()
                proc.wait(120)
    if not result_path.is_file():
        return _failed(spec, f"the worker exited with {rc} and wrote no result; see {logs / (spec.name + '.log')}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["wall_s"] = time.monotonic() - started
    return result


def round_prompts(prompts: Sequence[WorkloadPrompts], r: int) -> list[WorkloadPrompts]:
    """Round ``r`` of an interleaved run: every workload with its warm-up and only repeat ``r``."""
    return [WorkloadPrompts(p.workload, p.warmup, (p.repeats[r],)) for p in prompts]


def merge_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One engine's round results as one result: each workload's seconds and token ids in round
    order, start-up and idle memory from the first round (the others' start-ups listed beside it),
    the peaks the largest of any round, ``ok`` only when every round was. A failed round's error
    is the result's error; the rounds that ran still show."""
    if not rounds:
        raise ValueError("no rounds to merge")
    merged: dict[str, Any] = {k: v for k, v in rounds[0].items() if k not in ("workloads", "error", "traceback")}
    merged["workloads"] = {}
    for res in rounds:
        for name, w in res.get("workloads", {}).items():
            into = merged["workloads"].setdefault(name, {"seconds": [], "token_ids": []})
            into["seconds"] += list(w["seconds"])
            into["token_ids"] += list(w["token_ids"])
    merged["ok"] = all(bool(res.get("ok")) for res in rounds)
    failed = [(i, res) for i, res in enumerate(rounds) if not res.get("ok")]
    if failed:
        i, res = failed[0]
        merged["error"] = f"round {i + 1}: {res.get('error', 'failed')}"
    merged["rounds"] = len(rounds)
    merged["startup_s_rounds"] = [res["startup_s"] for res in rounds if "startup_s" in res]
    for key in ("rss_peak_mib", "pss_peak_mib", "peak_processes"):
        values = [res[key] for res in rounds if res.get(key) is not None]
        if values:
            merged[key] = max(values)
    merged["wall_s"] = sum(float(res.get("wall_s", 0.0)) for res in rounds)
    return merged


def run_rounds(specs: Sequence[EngineSpec], cfg: RunConfig, prompts: Sequence[WorkloadPrompts]) -> dict[str, Any]:
    """Every engine in turn once per repeat (``--interleave``), then each engine's rounds merged;
    the merged result also goes to the work folder, where ``--report-only`` reads it."""
    repeats = len(prompts[0].repeats) if prompts else 0
    per_engine: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    for r in range(repeats):
        print(f"bench peers: round {r + 1}/{repeats}", file=sys.stderr, flush=True)
        for spec in specs:
            per_engine[spec.name].append(run_engine(spec, cfg, round_prompts(prompts, r)))
    results = {name: merge_rounds(rounds) for name, rounds in per_engine.items()}
    for name, result in results.items():
        (cfg.work_dir / f"{name}.result.json").write_text(json.dumps(result))
    return results


def load_result(spec: EngineSpec, work_dir: Path) -> dict[str, Any]:
    """The result an earlier run left in ``work_dir`` (``--report-only``)."""
    path = work_dir / f"{spec.name}.result.json"
    if not path.is_file():
        return _failed(spec, f"no result in {work_dir}")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's flags (first processor)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def git_describe() -> str:
    """The commit the benchmark ran (with ``-dirty`` when the work tree had changes)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "?"
    return out.stdout.strip() or "?"
