"""``python bench/compare.py``: the same as ``kvmesh bench compare`` (see ``bench/serve/compare.py``).

python bench/compare.py --num-prompts 16 --input-len 128 --output-len 64 --write-docs docs/benchmarks.md
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

from services.bench_cli import compare_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(compare_main())
