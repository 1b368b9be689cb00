"""bench/peers.py's pure parts: workloads, identity counts, ratios, the rendered tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.peerbench import engines as eng
from bench.peerbench import wire
from bench.peerbench.orchestrate import RunConfig, job_for
from bench.peerbench.render import BEGIN, END, render, replace_section
from bench.peerbench.table import (
    Identity,
    build_report,
    common_prefix,
    identity,
    is_fp32,
    shown_flags,
    summary_table,
    target_lines,
    to_json,
    workload_table,
)
from bench.peerbench.workloads import FULL, QUICK, Workload, build_prompts, select


def test_full_workloads_are_the_issues() -> None:
    assert [(w.name, w.num_prompts, w.input_len, w.output_len, w.metric) for w in FULL] == [
        ("batch32", 32, 128, 128, "tok/s"),
        ("single", 1, 128, 128, "tok/s"),
        ("prefill8x1024", 8, 1024, 16, "wall s"),
    ]
    assert FULL[2].title == "8 x (1,024 in + 16 out)"
    assert FULL[0].output_tokens == 4096
    assert [w.name for w in QUICK] == [w.name for w in FULL]
    assert all(q.num_prompts * q.input_len < f.num_prompts * f.input_len for q, f in zip(QUICK, FULL, strict=True))


def test_select_workloads() -> None:
    assert select("all", quick=False) == FULL
    assert select("single,batch32", quick=True) == (QUICK[1], QUICK[0])
    with pytest.raises(ValueError, match="unknown workload"):
        select("batch64", quick=False)
    with pytest.raises(ValueError, match="metric"):
        Workload("x", 1, 1, 1, metric="ms")
    with pytest.raises(ValueError, match=">= 1"):
        Workload("x", 0, 1, 1)


def test_prompts_are_seeded_exact_and_fresh_per_repeat() -> None:
    w = Workload("w", 4, 16, 2)
    a = build_prompts(w, vocab_size=49152, repeats=3, seed=7, index=1)
    b = build_prompts(w, vocab_size=49152, repeats=3, seed=7, index=1)
    assert a == b  # the same for every engine
    assert len(a.repeats) == 3 and all(len(rep) == 4 for rep in a.repeats)
    assert all(len(p) == 16 for rep in a.repeats for p in rep) and all(len(p) == 16 for p in a.warmup)
    assert len(a.warmup) == 2
    flat = [t for rep in a.repeats for p in rep for t in p]
    assert min(flat) >= 1000 and max(flat) < 49152  # above the special-token range
    firsts = {p[:4] for rep in a.repeats for p in rep} | {p[:4] for p in a.warmup}
    assert len(firsts) == 14  # no repeat or warm-up prompt shares a prefix with another
    assert build_prompts(w, 49152, 1, seed=7, index=2).repeats[0] != a.repeats[0]
    with pytest.raises(ValueError, match="repeats"):
        build_prompts(w, 49152, 0, 0, 0)


def test_identity_counts_sequences_and_agreeing_prefix() -> None:
    ref = [[[1, 2, 3, 4], [5, 6, 7, 8]], [[9, 9, 9, 9]]]
    same = identity(ref, ref)
    assert same == Identity(3, 3, 4.0, 4) and same.all_identical and same.text() == "3/3"
    other = [[[1, 2, 0, 4], [5, 6, 7, 8]], [[0, 9, 9, 9]]]
    got = identity(ref, other)
    assert (got.identical, got.total, got.mean_prefix) == (1, 3, (2 + 4 + 0) / 3)
    assert got.text() == "1/3 (prefix 2.0/4)"
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0
    with pytest.raises(ValueError, match="same repeats"):
        identity(ref, ref[:1])


def test_fp32_names_and_cpu_flags() -> None:
    assert all(is_fp32(d) for d in ("float32", "F32", " f32 "))
    assert not any(is_fp32(d) for d in ("bfloat16", "Q4_1", "float16"))
    assert shown_flags(["sse", "amx_bf16", "avx2", "avx512_bf16", "avx512f"]) == ["avx2", "avx512f", "avx512_bf16",
                                                                                   "amx_bf16"]


def _result(seconds: list[float], tokens: list[list[list[int]]], dtype: str, wname: str = "single") -> dict[str, Any]:
    return {"ok": True, "resolved": {"dtype": dtype, "backend": "b"}, "startup_s": 2.0, "rss_idle_mib": 100.0,
            "rss_peak_mib": 150.0, "versions": {"x": "1"},
            "workloads": {wname: {"seconds": seconds, "token_ids": tokens}}}


def _report() -> Any:
    w = Workload("single", 1, 4, 4)
    ref_tokens = [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]
    results = {
        "vllm-default": _result([2.0, 4.0], [[[1, 2, 0, 0]], [[5, 6, 7, 8]]], "bfloat16"),
        "vllm-fp32": _result([4.0, 4.0], ref_tokens, "float32"),
        "kvmesh-suite-fp32": _result([1.0, 1.0], ref_tokens, "float32"),
        "llamacpp-f32": _result([8.0, 8.0], [[[1, 2, 3, 4]], [[5, 0, 7, 8]]], "F32"),
    }
    labels = {n: n.upper() for n in results}
    return w, build_report([w], list(results), labels, results, eng.reference(results), eng.BASELINE,
                           eng.FP32_BASELINE, {"command": "python bench/peers.py --x", "threads": 1, "repeats": 2})


def test_report_ratios_identity_and_tables() -> None:
    w, report = _report()
    assert report.reference == "kvmesh-suite-fp32"
    cell = report.cells[("vllm-default", "single")]
    assert (cell.seconds.median, cell.tok_s.median, cell.tok_s.low, cell.tok_s.high) == (3.0, 1.5, 1.0, 2.0)
    assert report.ratio("kvmesh-suite-fp32", "single", "vllm-default") == 4.0 / 1.5
    assert report.ratio("kvmesh-suite-fp32", "single", "vllm-fp32") == 4.0
    assert report.ratio("nope", "single", "vllm-fp32") is None
    assert report.cells[("vllm-default", "single")].identity == Identity(1, 2, 3.0, 4)
    rows = workload_table(report, w)
    assert rows[2] == "| VLLM-DEFAULT | bfloat16 / b | 1.5 (1.0 - 2.0) | 1.00x | 1.50x | 1/2 (prefix 3.0/4) |"
    assert rows[4] == "| KVMESH-SUITE-FP32 | float32 / b | 4.0 | 2.67x | 4.00x | 2/2 |"
    assert rows[5] == ("| LLAMACPP-F32 | F32 / b | 0.5 | 0.33x | 0.50x | 1/2 (prefix 2.5/4) "
                       "**fp32 row not identical** |")
    assert summary_table(report)[2] == "| 1 x (4 in + 4 out), output tok/s | 1.5 | 1.0 | 4.0 | 0.5 |"
    lines = target_lines(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)
    assert lines == ["- KVMESH-SUITE-FP32 vs the fastest llama.cpp (LLAMACPP-F32), single stream: 8.00x "
                     "(target >= 1.0x: met)"] * 2
    # weight-only rows get the single-stream check where they ran (a row absent here adds nothing)
    assert target_lines(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA, ("kvmesh-suite-q4_1",)) == lines
    assert target_lines(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA, ("vllm-fp32",)) == [
        *lines, "- VLLM-FP32 vs the fastest llama.cpp (LLAMACPP-F32), single stream: 2.00x (target >= 1.0x: met)"]
    doc = to_json(report)
    assert json.loads(json.dumps(doc))["cells"][0]["ratio_vs_baseline"] == 1.0
    assert doc["outputs"]["vllm-fp32"]["single"]["token_ids"] == [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]
    text = render(report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)
    assert "python bench/peers.py --x" in text and "#### 1 x (4 in + 4 out)" in text
    assert "CPU flags that pick the fast dtype: none; vendor not recorded." in text  # a run before the vendor
    report.meta.update(cpu_flags=["avx512f", "avx512_bf16"], cpu_vendor="GenuineIntel")
    assert "CPU flags that pick the fast dtype: avx512f, avx512_bf16; vendor GenuineIntel." in render(
        report, "kvmesh-suite-fp32", "kvmesh-suite-fp32", eng.LLAMA)


def test_wall_seconds_figure_for_prefill_bound_workloads() -> None:
    w = Workload("prefill8x1024", 2, 8, 2, metric="wall s")
    results = {"vllm-default": _result([3.0, 5.0, 4.0], [[[1, 1]] * 2] * 3, "bfloat16", w.name)}
    report = build_report([w], ["vllm-default"], {"vllm-default": "V"}, results, None, eng.BASELINE,
                          eng.FP32_BASELINE, {})
    assert workload_table(report, w)[2] == "| V | bfloat16 / b | 4.00 (3.00 - 5.00) | 1.00x | - | - |"


def test_reference_is_kvmesh_exact_mode_that_ran_in_fp32() -> None:
    ok = {"ok": True, "resolved": {"dtype": "float32"}}
    assert eng.reference({"kvmesh-inproc-fp32": ok}) == "kvmesh-inproc-fp32"
    assert eng.reference({"kvmesh-suite-fp32": ok, "kvmesh-inproc-fp32": ok}) == "kvmesh-suite-fp32"
    assert eng.reference({"kvmesh-suite-fp32": {"ok": True, "resolved": {"dtype": "bfloat16"}}}) is None
    assert [e.name for e in eng.select("vllm-fp32,kvmesh-suite-auto")] == ["vllm-fp32", "kvmesh-suite-auto"]
    with pytest.raises(ValueError, match="unknown engine"):
        eng.select("sglang")


def test_replace_section_in_docs() -> None:
    doc = "# B\n\ntext\n"
    once = replace_section(doc, "## R1\n")
    assert once == f"# B\n\ntext\n\n{BEGIN}\n\n## R1\n\n{END}\n"
    assert replace_section(once + "after\n", "## R2") == f"# B\n\ntext\n\n{BEGIN}\n\n## R2\n\n{END}\nafter\n"


def test_job_carries_prompts_settings_and_gguf_path(tmp_path: Path) -> None:
    w = Workload("single", 1, 4, 3)
    prompts = [build_prompts(w, 64, 2, 0, 0)]
    cfg = RunConfig(model_dir=tmp_path, work_dir=tmp_path, pythons={}, threads=1, ggufs=(("q4_1", "/x/q.gguf"),))
    job = job_for(eng.BY_NAME["llamacpp-q4_1"], cfg, prompts)
    assert job["settings"] == {"gguf": "/x/q.gguf", "kv_type": "f16"} and job["threads"] == 1
    assert job["workloads"][0]["repeats"] == [[list(p) for p in rep] for rep in prompts[0].repeats]
    with pytest.raises(KeyError):
        job_for(eng.BY_NAME["llamacpp-f32"], cfg, prompts)  # no F32 GGUF was made


class _Counting:
    """An engine that returns ``n`` tokens per prompt: the loop must refuse any other length."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.short = bool(job["settings"].get("short"))

    def generate(self, prompts: Any, output_len: int) -> list[list[int]]:
        n = output_len - 1 if self.short and output_len > 2 else output_len
        return [[p[0]] * n for p in prompts]

    def resolved(self) -> dict[str, str]:
        return {"dtype": "float32"}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("short", [False, True])
def test_worker_loop_times_every_repeat_and_refuses_wrong_lengths(tmp_path: Path, short: bool) -> None:
    job = {"engine": "e", "settings": {"short": short}, "warmup_output_len": 2,
           "workloads": [{"name": "w", "output_len": 3, "warmup": [[7]], "repeats": [[[1], [2]], [[3], [4]]]}]}
    out = tmp_path / "r.json"
    rc = wire.serve_job(job, str(out), _Counting, {"v": "1"})
    result = json.loads(out.read_text())
    assert rc == int(short) and result["ok"] is not short
    if short:
        assert result["error"] == "RuntimeError: w: expected 2 x 3 tokens, got lengths [2, 2]"
    else:
        assert result["workloads"]["w"]["token_ids"] == [[[1, 1, 1], [2, 2, 2]], [[3, 3, 3], [4, 4, 4]]]
        assert len(result["workloads"]["w"]["seconds"]) == 2 and result["rss_peak_mib"] > 0


def test_report_only_reads_what_a_run_left(tmp_path: Path) -> None:
    from bench.peerbench.orchestrate import load_result

    spec = eng.BY_NAME["vllm-fp32"]
    missing = load_result(spec, tmp_path)
    assert (missing["ok"], missing["error"], missing["workloads"]) == (False, f"no result in {tmp_path}", {})
    (tmp_path / "vllm-fp32.result.json").write_text(json.dumps(_result([1.0], [[[1]]], "float32")))
    assert load_result(spec, tmp_path)["workloads"]["single"]["seconds"] == [1.0]
