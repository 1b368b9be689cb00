"""What machine a comparison ran on, and how busy it was (other processes skew every figure)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class MachineInfo:
    """Cores, memory, load averages at the start and end of the run, and the library versions."""

    cpu_count: int
    cpu_model: str
    mem_total_gib: float
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    python: str
    torch: str
    transformers: str


def _meminfo_gib(path: str = "/proc/meminfo") -> float:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def _cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def load_average() -> tuple[float, float, float]:
    """1, 5 and 15-minute load averages (zeros where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def machine_info(load_start: tuple[float, float, float]) -> MachineInfo:
    """The machine now; ``load_start`` is :func:`load_average` taken when the run began."""
    return MachineInfo(
        cpu_count=os.cpu_count() or 0,
        cpu_model=_cpu_model(),
        mem_total_gib=_meminfo_gib(),
        load_start=load_start,
        load_end=load_average(),
        python=platform.python_version(),
        torch=_version("torch"),
        transformers=_version("transformers"),
    )
