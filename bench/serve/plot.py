"""``--plot out.png``: latency percentiles and throughput over time, one PNG (matplotlib, Agg backend).

Left: median / p90 / p99 of TTFT, TPOT, ITL and E2EL (ms, log scale: they span orders of
magnitude). Right: output tokens per second (1-second bins; 40 bins for runs under
40 s) and requests in flight, which shows ramp-up, steady state and the tail that the single
summary numbers hide.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.serve.driver import RequestRecord
from bench.serve.metrics import Summary, output_timeline


def in_flight(records: Sequence[RequestRecord], bin_seconds: float, num_bins: int) -> list[int]:
    """Requests in flight at the start of each bin."""
    return [sum(r.send_time <= b * bin_seconds < r.end_time for r in records) for b in range(num_bins)]


def auto_bin(duration: float) -> float:
    """1-second bins, or 40 bins for runs shorter than 40 s (so a short run is not a single point)."""
    return 1.0 if duration >= 40 else max(duration / 40, 0.005)


def plot_run(
    records: Sequence[RequestRecord],
    summary: Summary,
    path: str | Path,
    title: str = "",
    bin_seconds: float | None = None,
) -> Path:
    """Writes the PNG and returns its path (matplotlib is imported here, only when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    bin_seconds = bin_seconds or auto_bin(summary.duration_s)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["TTFT", "TPOT", "ITL", "E2EL"]
    stats = [summary.ttft_ms, summary.tpot_ms, summary.itl_ms, summary.e2el_ms]
    width = 0.27
    for i, (label, attr) in enumerate((("median", "median"), ("p90", "p90"), ("p99", "p99"))):
        values = [max(getattr(s, attr), 1e-3) for s in stats]
        left.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=label)
    left.set_xticks(range(len(names)), names)
    left.set_yscale("log")
    left.set_ylabel("ms")
    left.set_title("Latency percentiles")
    left.legend()

    tokens = output_timeline(ok, bin_seconds)
    times = [b * bin_seconds for b in range(len(tokens))]
    right.step(times, tokens, where="post", color="tab:blue", label="output tok/s")
    right.set_xlabel("seconds since start")
    right.set_ylabel("output tokens/s", color="tab:blue")
    twin = right.twinx()
    twin.step(times, in_flight(ok, bin_seconds, len(tokens)), where="post", color="tab:orange", label="in flight")
    twin.set_ylabel("requests in flight", color="tab:orange")
    right.set_title(f"Throughput over time (mean {summary.output_throughput:.1f} tok/s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
