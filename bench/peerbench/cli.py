"""``python bench/peers.py``: arguments, then every engine one after the other, then the report.

Installs nothing. The peers' venvs come from ``--peers-dir`` (``$KVMESH_PEERS_DIR``, default
``~/.cache/kvmesh/peers``; ``make peers`` creates them there) or ``--vllm-venv`` /
``--llamacpp-venv``; kvmesh runs with this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.peerbench import engines as eng
from bench.peerbench.gguf import f32_gguf, q4_1_gguf
from bench.peerbench.orchestrate import RunConfig, cpu_flags, git_describe, load_result, run_engine, run_rounds
from bench.peerbench.render import render, replace_section
from bench.peerbench.table import build_report, shown_flags, to_json
from bench.peerbench.workloads import build_prompts, select
from bench.serve.machine import load_average, machine_info
from services.model_runner.native import cpu_vendor

LLAMA_SDIST = "llama_cpp_python-0.3.36"
ROOT = Path(__file__).resolve().parents[2]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    peers = os.environ.get("KVMESH_PEERS_DIR") or str(Path.home() / ".cache" / "kvmesh" / "peers")
    p = argparse.ArgumentParser(prog="bench/peers.py", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=os.environ.get("KVMESH_MODEL_DIR", ""),
                   help="HF folder (default: $KVMESH_MODEL_DIR, else the prepared embedded SmolLM2-135M-Instruct)")
    p.add_argument("--peers-dir", default=peers, help="where make peers put vllm/, llamacpp/ and src/")
    p.add_argument("--vllm-venv", default="", help="vLLM's venv (default: PEERS_DIR/vllm)")
    p.add_argument("--llamacpp-venv", default="", help="llama-cpp-python's venv (default: PEERS_DIR/llamacpp)")
    p.add_argument("--convert-script", default="", help="convert_hf_to_gguf.py (default: the one in PEERS_DIR/src)")
    p.add_argument("--work-dir", default="", help="job files, logs, the F32 GGUF (default: PEERS_DIR/work)")
    p.add_argument("--engines", default="all", help=f"comma list from {', '.join(eng.BY_NAME)}")
    p.add_argument("--workloads", default="all", help="comma list from batch32, single, prefill8x1024")
    p.add_argument("--quick", action="store_true", help="small workloads: a smoke run of every engine")
    p.add_argument("--threads", type=int, default=1, help="compute threads for every engine alike")
    p.add_argument("--repeats", type=int, default=0, help="repeats per workload (default 3, --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    p.add_argument("--engine-timeout", type=float, default=2400.0, help="seconds one engine may take in all")
    p.add_argument("--note", action="append", default=[], help="a line for the report (repeatable)")
    p.add_argument("--out", default="bench/results/peers", help="writes OUT.json and OUT.md")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip bench/roofline.py (run first, on the idle machine: bandwidth, GEMM peaks, decode step)")
    p.add_argument("--interleave", action="store_true",
                   help="run the repeats as rounds, every engine started afresh in each (a machine whose speed "
                        "drifts over the run then slows every engine alike; one start-up per engine and round)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: report the results an earlier run left in the work folder")
    p.add_argument("--write-docs", default="", help="replace the generated section of this markdown file")
    return p.parse_args(argv)


def _model_dir(ns: argparse.Namespace) -> Path:
    if ns.model:
        return Path(ns.model)
    from services.model_runner.prepare import default_cache_dir, prepare_default_model

    return prepare_default_model(default_cache_dir())


def _roofline(ns: argparse.Namespace, model_dir: Path, work: Path) -> str:
    """Runs ``bench/roofline.py`` (this interpreter, the same threads) into the work folder; its markdown
    (also an earlier run's, with ``--report-only``), or "" when it did not run."""
    out = work / "roofline"
    if not ns.report_only:
        cmd = [sys.executable, str(ROOT / "bench" / "roofline.py"), "--model", str(model_dir),
               "--threads", str(ns.threads), "--out", str(out)] + (["--quick"] if ns.quick else [])
        _say("starting the roofline: " + shlex.join(cmd))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, timeout=ns.engine_timeout)
        except subprocess.TimeoutExpired:
            _say("the roofline timed out")
            return ""
        if done.returncode != 0:
            _say(f"the roofline exited with {done.returncode}")
            return ""
    md = out.with_suffix(".md")
    return md.read_text() if md.is_file() else ""


def _say(message: str) -> None:
    print(f"bench peers: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the comparison; 0 when every engine produced every workload, 1 otherwise."""
    ns = parse(argv)
    command = "python bench/peers.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    started, load_start = time.perf_counter(), load_average()
    workloads = select(ns.workloads, ns.quick)
    specs = eng.select(ns.engines)
    repeats = ns.repeats or (1 if ns.quick else 3)
    peers = Path(ns.peers_dir)
    model_dir = _model_dir(ns)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = [build_prompts(w, vocab, repeats, ns.seed, i) for i, w in enumerate(workloads)]
    pythons = {"vllm": str(Path(ns.vllm_venv or peers / "vllm") / "bin" / "python"),
               "llamacpp": str(Path(ns.llamacpp_venv or peers / "llamacpp") / "bin" / "python"),
               "kvmesh": sys.executable, "openai": sys.executable}
    work = Path(ns.work_dir or peers / "work")
    ggufs: dict[str, str] = {}
    if any(s.kind == "llamacpp" for s in specs) and not ns.report_only:
        sdist = peers / "src" / LLAMA_SDIST / "vendor" / "llama.cpp"
        script = Path(ns.convert_script or sdist / "convert_hf_to_gguf.py")
        try:
            ggufs["f32"] = str(f32_gguf(model_dir, script, pythons["vllm"], work / "gguf"))
        except (OSError, RuntimeError) as exc:
            _say(f"no F32 GGUF: {exc}")
        try:
            ggufs["q4_1"] = str(q4_1_gguf())
        except Exception as exc:  # NOTE: reported as that row's failure, the rest still runs
            _say(f"no Q4_1 GGUF: {exc}")
    cfg = RunConfig(model_dir=model_dir, work_dir=work, pythons=pythons, threads=ns.threads,
                    engine_timeout_s=ns.engine_timeout, vllm_enforce_eager=not ns.vllm_compile,
                    ggufs=tuple(ggufs.items()))
    roofline_md = "" if ns.no_roofline else _roofline(ns, model_dir, work)
    if ns.report_only:
        results = {s.name: load_result(s, work) for s in specs}
    elif ns.interleave:
        results = run_rounds(specs, cfg, prompts)
    else:
        results = {s.name: run_engine(s, cfg, prompts) for s in specs}
    meta = {"command": command, "machine": vars(machine_info(load_start)), "cpu_flags": shown_flags(cpu_flags()),
            "cpu_vendor": cpu_vendor(),  # with the flags, what picks bf16 mode's arithmetic (native.bf16_in_fma)
            "threads": ns.threads, "repeats": repeats, "seed": ns.seed, "elapsed_s": time.perf_counter() - started,
            "git": git_describe(), "notes": list(ns.note), "model_dir": str(model_dir), "ggufs": ggufs,
            "vllm_enforce_eager": cfg.vllm_enforce_eager, "interleave": bool(ns.interleave)}
    report = build_report(workloads, [s.name for s in specs], {s.name: s.label for s in specs}, results,
                          eng.reference(results), eng.BASELINE, eng.FP32_BASELINE, meta)
    text = render(report, eng.DEFAULT_KVMESH, eng.EXACT_KVMESH, eng.LLAMA, eng.HTTP_PAIRS, roofline_md,
                  eng.WEIGHT_ONLY_KVMESH)
    print(text)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(to_json(report), indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    _say(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    if ns.write_docs:
        doc = Path(ns.write_docs)
        doc.write_text(replace_section(doc.read_text(), text))
        _say(f"updated {doc}")
    complete = all(r.get("ok") for r in results.values()) and len(report.cells) == len(specs) * len(workloads)
    return 0 if complete else 1
