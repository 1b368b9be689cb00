"""``kvmesh bench compare``: kvmesh and its peers on the same prompts, in one run, as ratios.

Three measurements, each repeated ``repeats`` times (medians with min-max spread: the machine is
shared and noisy):

1. **Throughput** (output tokens/s), ``num_prompts`` random prompts of ``input_len`` tokens, exactly
   ``output_len`` output tokens each, greedy, all offered at once, on every system of
   :mod:`bench.serve.systems`. Repeats interleave the systems.
2. **Prefix caching**: mean TTFT of ``prefix_requests`` prompts of ``prefix_prompt_len`` tokens whose
   first ``prefix_share`` are one shared "system prompt", sent one at a time (no queueing in the
   TTFT), with caching effectively off (a unique cache salt per request) and on (one salt, after a
   first request has put the prefix in the cache). Each repeat and mode uses fresh tokens.
3. **Memory**: slot occupancy and pool concurrency, sampled from the in-process engine during its
   throughput runs (:mod:`bench.serve.memory`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.serve.datasets import LengthDist, TokenSpace, prefix_dataset, random_dataset
from bench.serve.machine import MachineInfo, load_average, machine_info
from bench.serve.memory import MemoryReport, PoolSampler, memory_report
from bench.serve.metrics import Summary, summarize
from bench.serve.systems import SYSTEMS, DrivenSystem, Measurement, PeerSystem, open_system

DEFAULT_KV_CACHE_BYTES = 512 << 20  # the model-runner's default pool


@dataclass(frozen=True)
class CompareConfig:
    """What ``bench compare`` runs (defaults: the issue's moderate run on SmolLM2-135M)."""

    model_dir: str
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    repeats: int = 3
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    prefix_prompt_len: int = 2048
    prefix_share: float = 0.9
    prefix_requests: int = 4
    prefix_output_len: int = 4
    run_prefix: bool = True
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    progress: bool = True
    attention_backend: str = "auto"  # the kvmesh systems' RunnerConfig.attention_backend

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or not self.systems:
            raise ValueError(f"systems must be a non-empty subset of {', '.join(SYSTEMS)}, got {self.systems}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.0 <= self.prefix_share < 1.0:
            raise ValueError(f"prefix_share must be in [0, 1), got {self.prefix_share}")


@dataclass(frozen=True)
class Spread:
    """Median and min-max of repeated measurements."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of at least one value."""
        return cls(statistics.median(values), min(values), max(values), tuple(values))


@dataclass
class CompareResult:
    """Everything the comparison measured."""

    config: CompareConfig
    machine: MachineInfo
    throughput: dict[str, Spread]
    identical_to_reference: dict[str, int]
    reference: str
    prefix_ttft_off_ms: Spread | None = None
    prefix_ttft_on_ms: Spread | None = None
    prefix_hit_rate_on: float = 0.0
    memory: MemoryReport | None = None
    suite_summary: Summary | None = None
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def ratio(self, system: str, base: str = "suite") -> float | None:
        """``base`` tokens/s divided by ``system``'s (medians), None when either is missing."""
        a, b = self.throughput.get(base), self.throughput.get(system)
        if a is None or b is None or b.median <= 0:
            return None
        return a.median / b.median


def _say(message: str) -> None:
    print(f"bench compare: {message}", file=sys.stderr, flush=True)


def _vocab_size(model_dir: str) -> int:
    with open(Path(model_dir) / "config.json") as f:
        return int(json.load(f)["vocab_size"])


def _identical(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    return sum(tuple(x) == tuple(y) for x, y in zip(a, b, strict=True))


def _prefix_ttft(
    system: DrivenSystem, cfg: CompareConfig, space: TokenSpace, seed: int, cached: bool
) -> tuple[float, float]:
    """Mean TTFT (ms) of the measured prefix requests and their prefix-cache hit rate."""
    prefix_len = round(cfg.prefix_share * cfg.prefix_prompt_len)
    suffix = LengthDist(max(1, cfg.prefix_prompt_len - prefix_len))
    convs = prefix_dataset(
        cfg.prefix_requests + 1,
        prefix_len,
        1,
        suffix,
        LengthDist(cfg.prefix_output_len),
        space,
        seed,
        unique_salts=not cached,
    )
    if cached:
        system.drive(convs[:1], max_concurrency=1)  # puts the shared prefix in the cache
    run = system.drive(convs[1:], max_concurrency=1)
    failed = [r for r in run.records if not r.success]
    if failed:
        raise RuntimeError(f"prefix workload: {len(failed)} requests failed, e.g. {failed[0].error}")
    summary = summarize(run.records, run.duration)
    return summary.ttft_ms.mean, summary.prefix_cache_hit_rate


def _measure_all(
    opened: dict[str, DrivenSystem | PeerSystem],
    cfg: CompareConfig,
    prompts: list[list[int]],
    on_memory: Callable[[MemoryReport], None],
) -> dict[str, list[Measurement]]:
    results: dict[str, list[Measurement]] = {name: [] for name in opened}
    for rep in range(cfg.repeats):
        for name, system in opened.items():
            sampler = None
            if isinstance(system, DrivenSystem) and system.inprocess is not None:
                sampler = PoolSampler(system.inprocess).start()
            m = system.measure(prompts, cfg.output_len)
            if sampler is not None and isinstance(system, DrivenSystem):
                preempted = sampler.stop()
                info = system.inprocess.engine.info
                usable = system.inprocess.manager.stats().num_blocks  # the pool minus the null block
                on_memory(
                    memory_report(
                        sampler.samples,
                        preempted,
                        info.block_size,
                        info.num_blocks,
                        usable,
                        info.max_model_len,
                        cfg.input_len + cfg.output_len,
                    )
                )
            results[name].append(m)
            _say(f"repeat {rep + 1}/{cfg.repeats}: {name}: {m.tokens_per_second:.1f} output tok/s")
    return results


def run_compare(cfg: CompareConfig) -> CompareResult:
    """Opens every system, measures, closes them; returns the result (see the module docstring)."""
    started = time.perf_counter()
    load_start = load_average()
    space = TokenSpace.for_vocab(_vocab_size(cfg.model_dir))
    convs = random_dataset(cfg.num_prompts, LengthDist(cfg.input_len), LengthDist(cfg.output_len), space, cfg.seed)
    prompts = [list(c.turns[0].user_token_ids) for c in convs]
    warm = prompts[:2]
    opened: dict[str, DrivenSystem | PeerSystem] = {}
    memories: list[MemoryReport] = []
    try:
        for name in cfg.systems:
            t = time.perf_counter()
            _say(f"starting {name} ...")
            opened[name] = open_system(name, cfg.model_dir, cfg.kv_cache_memory_bytes, cfg.progress,
                                       cfg.attention_backend)
            opened[name].measure(warm, 2)  # first-call costs (allocations, lazy init) out of the figures
            _say(f"{name} ready in {time.perf_counter() - t:.1f}s")
        runs = _measure_all(opened, cfg, prompts, memories.append)
        ref = "hf-static" if "hf-static" in runs else next(iter(runs))
        result = CompareResult(
            config=cfg,
            machine=machine_info(load_start),
            throughput={n: Spread.of([m.tokens_per_second for m in ms]) for n, ms in runs.items()},
            identical_to_reference={n: _identical(ms[-1].token_ids, runs[ref][-1].token_ids) for n, ms in runs.items()},
            reference=ref,
        )
        if "suite" in runs:
            result.suite_summary = runs["suite"][-1].summary
        if memories:
            result.memory = max(memories, key=lambda m: m.peak_blocks)
        driven = next((opened[n] for n in ("suite", "inprocess") if n in opened), None)
        if cfg.run_prefix and isinstance(driven, DrivenSystem):
            _run_prefix(result, driven, cfg, space)
    finally:
        for name, system in opened.items():
            try:
                system.close()
            except Exception as exc:  # NOTE: closing must not hide the measurement's own error
                _say(f"closing {name} failed: {exc}")
    result.machine = machine_info(load_start)
    result.elapsed_s = time.perf_counter() - started
    return result


def _run_prefix(result: CompareResult, system: DrivenSystem, cfg: CompareConfig, space: TokenSpace) -> None:
    off: list[float] = []
    on: list[float] = []
    hits: list[float] = []
    for rep in range(cfg.repeats):
        seed = cfg.seed + 1000 * (rep + 1)
        ttft_off, _ = _prefix_ttft(system, cfg, space, seed, cached=False)
        ttft_on, hit = _prefix_ttft(system, cfg, space, seed + 1, cached=True)
        off.append(ttft_off)
        on.append(ttft_on)
        hits.append(hit)
        _say(
            f"repeat {rep + 1}/{cfg.repeats}: prefix TTFT off {ttft_off:.0f} ms, on {ttft_on:.0f} ms "
            f"(hit rate {hit:.1%})"
        )
    result.prefix_ttft_off_ms = Spread.of(off)
    result.prefix_ttft_on_ms = Spread.of(on)
    result.prefix_hit_rate_on = statistics.median(hits)
