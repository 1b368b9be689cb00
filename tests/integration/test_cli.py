"""The command line end to end: ``kvmesh demo`` (what ``make run`` runs) on a tiny model, and a
scheduler refusing to start when its prefix-hash key differs from the kv-cache-manager's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.launcher import ServiceProcess, ServiceStartError


def test_demo_starts_the_suite_streams_an_answer_and_stops(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "services.cli", "demo", "--model", str(tiny_llama_dir), "--port", "0",
           "--http-port", "0", "--exit-after-demo", "--max-tokens", "5", "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for service in ("kv-cache-manager", "model-runner", "offload-store", "scheduler", "gateway"):
        assert re.search(rf"^  {service}\s+127\.0\.0\.1:\d+", out, re.M), out
    assert "user> What is the capital of France?" in out
    assert re.search(r"\[\d+ tokens, prompt \d+ \(0 cached\), TTFT \d+ ms", out), out
    assert "kvmesh: stopping" in out


def test_scheduler_refuses_a_different_deployment_key(tiny_llama_dir: Path, tmp_path: Path) -> None:
    common = {"KVMESH_MODEL_DIR": str(tiny_llama_dir), "KVMESH_RUNNER_WARMUP": "0"}
    with ServiceProcess("kv-cache-manager", env={**common, "KVMESH_DEPLOYMENT_KEY": "key-a"}) as kvm, \
            ServiceProcess("model-runner", env=common) as runner:
        env = {**common, "KVMESH_DEPLOYMENT_KEY": "key-b", "KVMESH_SCHED_KVM_ADDRESS": kvm.address,
               "KVMESH_SCHED_RUNNER_ADDRESS": runner.address}
        with pytest.raises(ServiceStartError, match="prefix-hash seed mismatch"):
            ServiceProcess("scheduler", env=env, startup_timeout=60, log_dir=str(tmp_path))
