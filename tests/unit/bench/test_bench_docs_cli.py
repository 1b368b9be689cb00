"""The generated docs section replaces only what lies between its markers; the CLI parses."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.serve.compare import CompareConfig, CompareResult, Spread
from bench.serve.docs import BEGIN, END, render, write_docs
from bench.serve.machine import MachineInfo
from services.bench_cli import add_bench_subcommand


def _result() -> CompareResult:
    machine = MachineInfo(2, "cpu", 23.5, (1.0, 1.0, 1.0), (2.5, 2.0, 1.5), "3.11", "2.13", "5.24")
    return CompareResult(
        config=CompareConfig(model_dir="/m", repeats=3),
        machine=machine,
        throughput={
            "suite": Spread.of([90.0, 100.0, 110.0]),
            "inprocess": Spread.of([100.0, 105.0, 95.0]),
            "hf-static": Spread.of([40.0, 45.0, 50.0]),
            "hf-cb": Spread.of([15.0, 20.0, 25.0]),
        },
        identical_to_reference={"suite": 16, "inprocess": 16, "hf-static": 16, "hf-cb": 15},
        reference="hf-static",
        prefix_ttft_off_ms=Spread.of([8000.0, 9000.0, 10000.0]),
        prefix_ttft_on_ms=Spread.of([900.0, 1000.0, 1100.0]),
        prefix_hit_rate_on=0.898,
    )


def test_render_has_tables_ratios_and_targets() -> None:
    text = render(_result())
    assert text.startswith(BEGIN) and text.rstrip().endswith(END)
    assert "| kvmesh gRPC suite (4 processes) | 100.0 | 90.0 - 110.0 | 1.00x | 16/16 |" in text
    assert "| transformers generate(), static cache | 45.0 | 40.0 - 50.0 | 2.22x | 16/16 |" in text
    assert "kvmesh ≥ 5x transformers generate_batch(), paged: 5.00x, met" in text
    assert "gRPC suite ≥ 90% of in-process: 100%, met" in text
    assert "TTFT off ÷ on: 9.0x (target ≥ 5x: met)" in text
    assert "2 cores" in text


def test_write_docs_keeps_the_prose_around_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{BEGIN}\nold tables\n{END}\n\n## Hand-run serve\n\nkept\n")
    write_docs(doc, _result())
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n" + BEGIN)
    assert "old tables" not in text
    assert text.endswith(f"{END}\n\n## Hand-run serve\n\nkept\n")
    assert text.count(BEGIN) == 1
    write_docs(doc, _result())  # idempotent
    assert doc.read_text() == text
    fresh = write_docs(tmp_path / "new.md", _result())
    assert fresh.read_text().startswith(BEGIN)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_bench_subcommand(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_parses_serve_and_compare() -> None:
    ns = _parser().parse_args(
        [
            "bench",
            "serve",
            "--address",
            "h:1",
            "--dataset",
            "multi-turn",
            "--turns",
            "4",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "8",
            "--ignore-eos",
            "--seed",
            "3",
            "--goodput",
            "ttft:500",
            "tpot:50",
        ]
    )
    assert (ns.address, ns.dataset, ns.turns, ns.max_concurrency, ns.seed) == ("h:1", "multi-turn", 4, 8, 3)
    assert math.isinf(ns.request_rate) and ns.goodput == ["ttft:500", "tpot:50"]
    ns = _parser().parse_args(["bench", "serve", "--request-rate", "2.5"])
    assert ns.request_rate == 2.5
    ns = _parser().parse_args(
        ["bench", "compare", "--systems", "suite", "hf-static", "--repeats", "1", "--write-docs", "docs/benchmarks.md"]
    )
    assert ns.systems == ["suite", "hf-static"] and ns.repeats == 1 and ns.prefix_prompt_len == 2048
