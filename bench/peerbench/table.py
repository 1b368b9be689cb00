"""Pure: the report of one ``bench/peers.py`` run (identity counts, ratios, markdown, JSON).

Inputs are the workers' result dicts (``wire.serve_job``) keyed by engine name; nothing here runs
an engine or reads the machine, so all of it is unit-tested without a peer.

- **Ratios** are speeds: an engine's output tok/s divided by the baseline's (medians of the
  repeats). For a prefill-bound workload the table shows wall seconds, and the same ratio is the
  baseline's wall time over the engine's (every engine produces the same number of tokens).
- **Identity** compares every sequence of every repeat with the reference engine's (kvmesh fp32,
  exact native) for the same prompts: how many sequences are identical end to end, and the mean
  length of the agreeing prefix (after the first different token, greedy outputs go separate ways,
  so later positions say nothing about precision).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.peerbench.workloads import Workload

FP32_NAMES = ("float32", "f32", "fp32", "all f32")
CPU_FLAGS_SHOWN = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Spread:
    """Median and min-max of the repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of at least one value."""
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class Identity:
    """Agreement of an engine's sequences with the reference's, over every repeat."""

    identical: int
    total: int
    mean_prefix: float  # mean number of leading tokens equal to the reference's
    length: int  # tokens per sequence

    @property
    def all_identical(self) -> bool:
        """Every sequence equal to the reference's."""
        return self.identical == self.total

    def text(self) -> str:
        """``29/32 (prefix 121.4/128)``, or ``32/32`` when all are identical."""
        if self.all_identical:
            return f"{self.identical}/{self.total}"
        return f"{self.identical}/{self.total} (prefix {self.mean_prefix:.1f}/{self.length})"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def identity(reference: Sequence[Sequence[Sequence[int]]], other: Sequence[Sequence[Sequence[int]]]) -> Identity:
    """Compares repeat by repeat, sequence by sequence (the same prompts in the same order)."""
    if len(reference) != len(other) or any(len(r) != len(o) for r, o in zip(reference, other, strict=False)):
        raise ValueError("identity needs the same repeats and prompts on both sides")
    pairs = [(r, o) for rep_r, rep_o in zip(reference, other, strict=True) for r, o in zip(rep_r, rep_o, strict=True)]
    if not pairs:
        raise ValueError("identity needs at least one sequence")
    same = sum(tuple(r) == tuple(o) for r, o in pairs)
    prefix = statistics.fmean(common_prefix(r, o) for r, o in pairs)
    return Identity(same, len(pairs), prefix, max(len(r) for r, _ in pairs))


def is_fp32(dtype: str) -> bool:
    """Whether a resolved dtype names full fp32 (kvmesh/vLLM ``float32``, llama.cpp ``F32``)."""
    return dtype.strip().lower() in FP32_NAMES


def shown_flags(flags: Sequence[str]) -> list[str]:
    """The CPU flags that decide the fast dtype, in a fixed order (``CPU_FLAGS_SHOWN``)."""
    have = set(flags)
    return [f for f in CPU_FLAGS_SHOWN if f in have]


@dataclass(frozen=True)
class Cell:
    """One engine on one workload."""

    seconds: Spread
    tok_s: Spread
    identity: Identity | None


@dataclass
class Report:
    """Everything one run measured, ready to render."""

    workloads: tuple[Workload, ...]
    order: tuple[str, ...]  # engines in run order
    labels: dict[str, str]
    results: dict[str, dict[str, Any]]
    cells: dict[tuple[str, str], Cell]
    reference: str | None
    baseline: str
    fp32_baseline: str
    meta: dict[str, Any]

    def ratio(self, engine: str, workload: str, base: str) -> float | None:
        """``engine``'s speed over ``base``'s on ``workload`` (medians), None if either is missing."""
        a, b = self.cells.get((engine, workload)), self.cells.get((base, workload))
        if a is None or b is None or b.tok_s.median <= 0:
            return None
        return a.tok_s.median / b.tok_s.median

    def dtype(self, engine: str) -> str:
        """The dtype the engine reported, or ``?``."""
        return str(self.results.get(engine, {}).get("resolved", {}).get("dtype", "?"))


def build_report(workloads: Sequence[Workload], order: Sequence[str], labels: Mapping[str, str],
                 results: Mapping[str, dict[str, Any]], reference: str | None, baseline: str, fp32_baseline: str,
                 meta: Mapping[str, Any]) -> Report:
    """Cells for every engine that produced a workload; identity against ``reference`` where it ran."""
    cells: dict[tuple[str, str], Cell] = {}
    ref = results.get(reference or "", {}).get("workloads", {})
    for name in order:
        for w in workloads:
            got = results.get(name, {}).get("workloads", {}).get(w.name)
            if not got or not got.get("seconds"):
                continue
            secs = [float(s) for s in got["seconds"]]
            ident = identity(ref[w.name]["token_ids"], got["token_ids"]) if w.name in ref else None
            cells[(name, w.name)] = Cell(Spread.of(secs), Spread.of([w.output_tokens / s for s in secs]), ident)
    return Report(tuple(workloads), tuple(order), dict(labels), dict(results), cells, reference, baseline,
                  fp32_baseline, dict(meta))


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def figure(cell: Cell, workload: Workload, spread: bool = True) -> str:
    """``96.7 (88.0 - 99.1)`` tok/s, or wall seconds for a prefill-bound workload."""
    if workload.metric == "wall s":
        s = cell.seconds
        return f"{s.median:.2f}" + (f" ({s.low:.2f} - {s.high:.2f})" if spread and s.low != s.high else "")
    t = cell.tok_s
    return f"{t.median:.1f}" + (f" ({t.low:.1f} - {t.high:.1f})" if spread and t.low != t.high else "")


def summary_table(report: Report) -> list[str]:
    """The issue's layout: one row per workload, one column per engine (medians)."""
    names = [n for n in report.order if any((n, w.name) in report.cells for w in report.workloads)]
    head = "| workload | " + " | ".join(f"{report.labels[n]} [{report.dtype(n)}]" for n in names) + " |"
    lines = [head, "|---|" + "---:|" * len(names)]
    for w in report.workloads:
        row = [figure(report.cells[(n, w.name)], w, False) if (n, w.name) in report.cells else "-" for n in names]
        lines.append(f"| {w.title}, {'output tok/s' if w.metric == 'tok/s' else 'wall s'} | " + " | ".join(row) + " |")
    return lines


def workload_table(report: Report, w: Workload) -> list[str]:
    """One workload: every engine's figure with spread, both ratios, identity with the reference."""
    unit = "output tok/s" if w.metric == "tok/s" else "wall s"
    lines = [f"| engine | dtype / backend | {unit} (median, min - max) | ÷ {report.baseline} "
             f"| ÷ {report.fp32_baseline} | identical to {report.reference or 'reference'} |",
             "|---|---|---:|---:|---:|---:|"]
    for n in report.order:
        cell = report.cells.get((n, w.name))
        if cell is None:
            continue
        res = report.results[n].get("resolved", {})
        ident = cell.identity.text() if cell.identity is not None else "-"
        if cell.identity is not None and is_fp32(report.dtype(n)) and not cell.identity.all_identical:
            ident += " **fp32 row not identical**"
        lines.append(f"| {report.labels[n]} | {res.get('dtype', '?')} / {res.get('backend', '?')} | {figure(cell, w)} "
                     f"| {_fmt_ratio(report.ratio(n, w.name, report.baseline))} "
                     f"| {_fmt_ratio(report.ratio(n, w.name, report.fp32_baseline))} | {ident} |")
    return lines


def _mib(r: Mapping[str, Any], key: str) -> str:
    return f"{r[key]:.0f}" if key in r else "-"


def engines_table(report: Report) -> list[str]:
    """Start-up, memory (RSS and PSS sums over the counted processes), versions and failures of every engine.

    ``counted``: ``server`` (the processes of a server the worker started and drives: kvmesh's suite,
    ``vllm serve``) or ``worker`` (the worker's whole tree, the engine living in it: vLLM offline with
    its engine core, llama.cpp, kvmesh in-process); the count is of processes at idle.
    """
    base = report.results.get(report.baseline, {})
    lines = ["| engine | start-up s | counted | RSS idle MiB | RSS peak MiB | PSS idle MiB | PSS peak MiB "
             f"| RSS peak ÷ {report.baseline} | versions | status |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for n in report.order:
        r = report.results.get(n, {})
        versions = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items())
        status = "ok" if r.get("ok") else f"failed: {r.get('error', 'no result')}"
        counted = f"{'worker' if r.get('rss_counts_worker', True) else 'server'}, {r.get('processes', '?')} proc."
        ratio = (_fmt_ratio(r["rss_peak_mib"] / base["rss_peak_mib"])
                 if r.get("ok") and r.get("rss_peak_mib") and base.get("rss_peak_mib") else "-")
        lines.append(f"| {report.labels[n]} | {r.get('startup_s', 0.0):.1f} | {counted} | {_mib(r, 'rss_idle_mib')} "
                     f"| {_mib(r, 'rss_peak_mib')} | {_mib(r, 'pss_idle_mib')} | {_mib(r, 'pss_peak_mib')} | {ratio} "
                     f"| {versions} | {status} |")
    return lines


def http_lines(report: Report, pairs: Sequence[tuple[str, str]]) -> list[str]:
    """kvmesh's gateway against ``vllm serve``, the same client and workload: speed ratios per workload."""
    out = []
    for mine, theirs in pairs:
        for w in report.workloads:
            r = report.ratio(mine, w.name, theirs)
            if r is not None:
                out.append(f"- {report.labels.get(mine, mine)} vs {report.labels.get(theirs, theirs)}, "
                           f"{w.title}: {r:.2f}x")
    return out


def target_lines(report: Report, default: str, exact: str, llama_engines: Sequence[str],
                 weight_only: Sequence[str] = ()) -> list[str]:
    """The issue's targets that this run can check (ratios of medians in this run); the single-stream
    one for the ``weight_only`` kvmesh rows too (opt-in quantizations, where they ran)."""
    out: list[str] = []

    def check(label: str, r: float | None, goal: float) -> None:
        if r is not None:
            out.append(f"- {label}: {r:.2f}x (target >= {goal}x: {'met' if r >= goal else '**not met**'})")

    name_d, name_e = report.labels.get(default, default), report.labels.get(exact, exact)
    check(f"{name_d} vs {report.baseline}, batch 32", report.ratio(default, "batch32", report.baseline), 1.5)
    check(f"{name_d} vs {report.baseline}, 8 x 1,024 prefill",
          report.ratio(default, "prefill8x1024", report.baseline), 1.2)
    check(f"{name_e} vs {report.fp32_baseline}, batch 32", report.ratio(exact, "batch32", report.fp32_baseline), 1.5)
    check(f"{name_e} vs {report.fp32_baseline}, 8 x 1,024 prefill",
          report.ratio(exact, "prefill8x1024", report.fp32_baseline), 1.3)
    fastest = max((n for n in llama_engines if (n, "single") in report.cells),
                  key=lambda n: report.cells[(n, "single")].tok_s.median, default=None)
    if fastest is not None:
        for n in (default, exact, *(n for n in weight_only if (n, "single") in report.cells)):
            check(f"{report.labels.get(n, n)} vs the fastest llama.cpp ({report.labels.get(fastest)}), single stream",
                  report.ratio(n, "single", fastest), 1.0)
    return out


def to_json(report: Report) -> dict[str, Any]:
    """The machine-readable result: meta, every cell (figures, ratios, identity), every engine's result."""
    cells = []
    for (n, wname), c in report.cells.items():
        cells.append({"engine": n, "workload": wname, "seconds": vars(c.seconds), "output_tok_s": vars(c.tok_s),
                      "ratio_vs_baseline": report.ratio(n, wname, report.baseline),
                      "ratio_vs_fp32_baseline": report.ratio(n, wname, report.fp32_baseline),
                      "identity": None if c.identity is None else vars(c.identity)})
    engines = {n: {k: v for k, v in r.items() if k != "workloads"} for n, r in report.results.items()}
    tokens = {n: r.get("workloads", {}) for n, r in report.results.items()}
    return {"meta": report.meta, "baseline": report.baseline, "fp32_baseline": report.fp32_baseline,
            "reference": report.reference, "labels": report.labels, "order": list(report.order),
            "workloads": [vars(w) for w in report.workloads], "cells": cells, "engines": engines, "outputs": tokens}
