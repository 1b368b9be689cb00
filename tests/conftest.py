"""Test-wide setup.

NOTE: TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it is set here,
at the top of the root conftest, before test modules import the kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
