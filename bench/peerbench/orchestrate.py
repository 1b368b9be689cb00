"""One engine after the other, each in its own subprocess with its own venv's python.

Each worker gets a job file (the prompts of every workload, its settings, the thread count) and
writes a result file (``wire.serve_job``); its output goes to a log in the work folder, and its
own progress lines are echoed. A worker that fails, times out or whose venv is missing becomes a
row saying so; the run goes on with the next engine.
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
