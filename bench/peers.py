"""``python bench/peers.py``: kvmesh vs vLLM's CPU engine and llama.cpp, same prompts, one run.

python bench/peers.py --peers-dir /work/peers --threads 1 --write-docs docs/benchmarks.md
python bench/peers.py --peers-dir /work/peers --quick          # a smoke run of every engine

The peers' venvs are made by ``make peers`` (never a test dependency); see docs/benchmarks.md.
Module map: ``bench/peerbench/__init__.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

from bench.peerbench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
